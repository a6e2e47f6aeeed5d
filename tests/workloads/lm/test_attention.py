"""Training attention (`lm/model/attention.py`): the splash kernel, run by Pallas's interpreter on CPU, computes causal
grouped-query attention and its gradients, alone and under a mesh; every implementation and the KV-cache decode
path agree under a sliding window; the choice of implementation per platform."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

from systolic.errors import ConfigError
from systolic.runtime.sharding import RULE_SETS, activate, logical_to_spec
from systolic.workloads.lm.model import attention

B, T, H, KV, HD = 2, 256, 4, 2, 64  # T = 2 splash blocks of 128: the causal mask has a skipped block


def _inputs():
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(kq, (B, T, H, HD))
    k, v = jax.random.normal(kk, (B, T, KV, HD)), jax.random.normal(kv, (B, T, KV, HD))
    return q, k, v, jax.random.normal(kd, (B, T, H, HD))  # d_out: a cotangent that weights every output


def _reference(q, k, v, *, window=0, segment_ids=None):
    """float64 NumPy causal grouped-query attention: query head h reads key/value head h // (H // KV); with a
    window W only keys with query - key < W (transformers' sliding window); with segment ids only its segment's."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    k, v = np.repeat(k, H // KV, axis=2), np.repeat(v, H // KV, axis=2)  # (B, T, H, hd)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD)
    query, key = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (key <= query) & ((query - key < window) if window else True)  # (T, T)
    if segment_ids is not None:
        ids = np.asarray(segment_ids)
        allowed = allowed & (ids[:, None, :, None] == ids[:, None, None, :])  # (B, 1, T, T)
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def _value_and_grads(impl, **kw):
    """out and d(sum(out * d_out))/d(q, k, v) with `impl` (and causal_attention's keywords `kw`), jitted."""

    def f(q, k, v, d_out):
        out, pullback = jax.vjp(lambda *a: attention.causal_attention(*a, impl=impl, **kw), q, k, v)
        return out, pullback(d_out)

    return jax.jit(f)


@pytest.fixture(scope="module")
def expected():
    q, k, v, d_out = _inputs()
    out, grads = _value_and_grads("xla")(q, k, v, d_out)
    np.testing.assert_allclose(out, _reference(q, k, v), atol=2e-5)  # the float32 reference is itself right
    return out, grads


def test_splash_matches_the_reference_forward_and_backward(expected):
    start = time.perf_counter()
    out, grads = _value_and_grads("splash")(*_inputs())
    np.testing.assert_allclose(out, _reference(*_inputs()[:3]), atol=2e-5)
    for name, got, want in zip("qkv", grads, expected[1]):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5, err_msg=f"d{name}")
    print(f"splash, interpreted, forward + backward: {time.perf_counter() - start:.1f} s")


def test_splash_under_a_mesh_splits_batch_and_heads(expected):
    # 4 of the 8 devices: the batch of 2 over fsdp, the 4 query and 2 key/value heads over tensor.
    mesh = jax.make_mesh((1, 1, 2, 1, 1, 2), ("data", "stage", "fsdp", "expert", "context", "tensor"), axis_types=(AxisType.Auto,) * 6,
                         devices=jax.devices()[:4])
    rules = RULE_SETS["default"]  # batch over data x fsdp, heads and kv_heads over tensor
    q, k, v, d_out = _inputs()
    q_sharding = NamedSharding(mesh, logical_to_spec(("batch", "seq", "heads", "head_dim"), rules))
    kv_sharding = NamedSharding(mesh, logical_to_spec(("batch", "seq", "kv_heads", "head_dim"), rules))
    q, d_out = jax.device_put(q, q_sharding), jax.device_put(d_out, q_sharding)
    k, v = jax.device_put(k, kv_sharding), jax.device_put(v, kv_sharding)
    with activate(mesh, rules):
        step = _value_and_grads("splash")
        out, grads = step(q, k, v, d_out)
        hlo = step.lower(q, k, v, d_out).compile().as_text()
    assert out.sharding.is_equivalent_to(q_sharding, 4), out.sharding
    assert "all-gather" not in hlo, "the kernel's operands were gathered: it did not run per shard"
    np.testing.assert_allclose(out, expected[0], atol=2e-5)
    for name, got, want in zip("qkv", grads, expected[1]):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5, err_msg=f"d{name}")


# SLIDING WINDOW -----------------------------------------------------------------------------------------------

WINDOW = 100  # over 256 positions and across splash's 128-position blocks: some blocks lie partly in the window
SEGMENTS = np.stack([np.searchsorted([60, 200], np.arange(T), side="right"),  # documents [0, 60), [60, 200), [200, T)
                     np.searchsorted([150], np.arange(T), side="right")]).astype(np.int32)  # (B, T)


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
@pytest.mark.parametrize("impl", ["xla", "cpu", "splash"])
def test_sliding_window_in_every_implementation(impl, packed):
    """Each training implementation gives the float64 reference's output under a window, alone and with packed
    documents, and the gradients of the plain XLA formulation."""
    segment_ids = jnp.asarray(SEGMENTS) if packed else None
    q, k, v, d_out = _inputs()
    out, grads = _value_and_grads(impl, window=WINDOW, segment_ids=segment_ids)(q, k, v, d_out)
    want = _reference(q, k, v, window=WINDOW, segment_ids=segment_ids)
    np.testing.assert_allclose(out, want, atol=2e-5)
    assert np.abs(want - _reference(q, k, v, segment_ids=segment_ids)).max() > 0.1  # the window matters
    if impl != "xla":
        _, xla_grads = _value_and_grads("xla", window=WINDOW, segment_ids=segment_ids)(q, k, v, d_out)
        for name, got, expected_grad in zip("qkv", grads, xla_grads):
            np.testing.assert_allclose(got, expected_grad, atol=5e-5, rtol=1e-5, err_msg=f"{impl}: d{name}")


def test_decode_path_masks_the_window_as_training_does():
    """A model with a window of 5 over 16 tokens: its training forward (xla, and the cpu formulation that auto
    picks here) and the KV-cache decode path (the prompt, then one token at a time) give the same logits."""
    from systolic.workloads.lm.model.config import ModelConfig
    from systolic.workloads.lm.model.transformer import make_model

    cfg = ModelConfig(d_model=32, layers=2, heads=4, kv_heads=2, max_seq_len=32, dtype="float32", sliding_window=5)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
    training = {setting: make_model(dataclasses.replace(cfg, attention=setting), 64, 0)(tokens)
                for setting in ("xla", "auto")}
    model = make_model(cfg, 64, 0)
    logits, cache = model.decode(tokens[:, :6], model.init_cache(2, 16))  # (B, 6, V)
    steps = [logits]
    for t in range(6, 16):
        logits, cache = model.decode(tokens[:, t : t + 1], cache)  # (B, 1, V)
        steps.append(logits)
    decoded = jnp.concatenate(steps, axis=1)  # (B, T, V)
    for setting, logits in training.items():
        np.testing.assert_allclose(decoded, logits, atol=1e-5, err_msg=setting)
    unwindowed = make_model(dataclasses.replace(cfg, sliding_window=0), 64, 0)(tokens)
    assert np.abs(np.asarray(unwindowed - decoded)).max() > 1e-3  # the window matters


def test_cudnn_call_takes_the_window(monkeypatch):
    """No GPU here: trace the cudnn path, with jax's cuDNN version probe stubbed, with packed documents and a
    window: the kernel gets the window as its sliding_window_length, forward and backward."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    q, kv = jnp.zeros((B, T, H, HD), jnp.bfloat16), jnp.zeros((B, T, KV, HD), jnp.bfloat16)

    def loss(q, k, v):
        out = attention.causal_attention(q, k, v, impl="cudnn", segment_ids=jnp.asarray(SEGMENTS), window=WINDOW)
        return out.astype(jnp.float32).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv).jaxpr
    windows = {str(e.primitive): e.params["sliding_window_length"]
               for e in jaxpr.eqns if "dot_product_attention" in str(e.primitive)}
    assert windows == {f"dot_product_attention_{d}_wrapper": WINDOW for d in ("fwd", "bwd")}


# CHOICE OF IMPLEMENTATION -------------------------------------------------------------------------------------


@pytest.mark.parametrize("platform, dtype, head_dim, want", [
    ("tpu", jnp.bfloat16, 64, "splash"),
    ("tpu", jnp.float32, 80, "splash"),
    ("gpu", jnp.bfloat16, 128, "cudnn"),
    ("gpu", jnp.float32, 128, "xla"),  # cuDNN's flash attention is half precision only
    ("gpu", jnp.bfloat16, 160, "xla"),
    ("cpu", jnp.float32, 64, "cpu"),  # lm/model/cpu.py's formulation, the CPU tweaks being on by default
])
def test_auto_picks_by_platform(monkeypatch, platform, dtype, head_dim, want):
    monkeypatch.setattr(attention, "compile_platform", lambda: platform)
    monkeypatch.setattr(attention, "device_platform", lambda: platform)
    monkeypatch.setattr(attention.cpu, "compile_platform", lambda: platform)
    assert attention.choose("auto", dtype=dtype, head_dim=head_dim, seq_len=256) == want


def test_auto_falls_back_to_xla_on_tpu_where_splash_cannot_split_the_sequence(monkeypatch):
    monkeypatch.setattr(attention, "compile_platform", lambda: "tpu")
    assert attention.choose("auto", dtype=jnp.bfloat16, head_dim=64, seq_len=200) == "xla"
    with pytest.raises(ConfigError, match=r"data.seq_len a multiple of 128"):
        attention.choose("splash", dtype=jnp.bfloat16, head_dim=64, seq_len=200)


def test_forced_choices_act_or_say_why_not():
    assert attention.choose("splash", dtype=jnp.float32, head_dim=64, seq_len=256) == "splash"
    assert attention.choose("xla", dtype=jnp.float32, head_dim=64, seq_len=200) == "xla"
    with pytest.raises(ConfigError, match="needs an NVIDIA GPU.*compiled for cpu"):
        attention.choose("cudnn", dtype=jnp.bfloat16, head_dim=64, seq_len=256)


def test_splash_blocks_follow_the_sequence_length():
    assert [attention.splash_block(t) for t in (128, 256, 384, 1024, 2048)] == [128, 256, 128, 512, 512]
    with pytest.raises(ConfigError, match=r"data.seq_len a multiple of 128 \(e.g. 256\).*model.attention=xla"):
        attention.splash_block(200)


def test_model_trains_the_same_with_splash_and_xla_under_a_mesh():
    """The real model, layers scanned and rematerialised, on a mesh: splash (in its shard_map, inside nnx.scan and
    nnx.remat) gives the loss and gradients of the plain formulation."""
    import optax
    from flax import nnx

    from systolic.workloads.lm.model.config import ModelConfig
    from systolic.workloads.lm.model.transformer import make_model

    cfg = ModelConfig(d_model=64, layers=1, heads=4, kv_heads=2, max_seq_len=128, dtype="float32", scan_layers=True,
                      remat="full")
    mesh = jax.make_mesh((1, 1, 2, 1, 1, 2), ("data", "stage", "fsdp", "expert", "context", "tensor"), axis_types=(AxisType.Auto,) * 6,
                         devices=jax.devices()[:4])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 128)), jnp.int32)

    def loss_and_grads(setting, *, traces=1):
        model_cfg = dataclasses.replace(cfg, attention=setting)
        with activate(mesh, RULE_SETS["default"]):
            graphdef, params = nnx.split(make_model(model_cfg, 64, 0), nnx.Param)
            loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
                nnx.merge(graphdef, p)(tokens), tokens).mean()
            for _ in range(traces - 1):  # a kernel cached across traces would leak this trace's values into the next
                jax.jit(jax.value_and_grad(loss)).trace(params)
            return jax.jit(jax.value_and_grad(loss))(params)

    (loss_xla, grads_xla), (loss_splash, grads_splash) = loss_and_grads("xla"), loss_and_grads("splash", traces=2)
    np.testing.assert_allclose(loss_splash, loss_xla, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_splash), jax.tree.leaves(grads_xla)):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_splash_compiles_for_tpu_devices_from_this_host():
    """Under a mesh of compile-only TPU devices (what `systolic plan` compiles for), auto is the Mosaic kernel, not
    its interpreter, and the (T, T) scores are gone from the temporaries. Needs libtpu (the TPU compiler)."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    mesh = jax.make_mesh((1, 1, 2, 1, 1, 2), ("data", "stage", "fsdp", "expert", "context", "tensor"), axis_types=(AxisType.Auto,) * 6,
                         devices=devices)
    rules = RULE_SETS["default"]
    q = jax.ShapeDtypeStruct((8, 2048, 16, 128), jnp.bfloat16, sharding=NamedSharding(
        mesh, logical_to_spec(("batch", "seq", "heads", "head_dim"), rules)))
    k = jax.ShapeDtypeStruct((8, 2048, 8, 128), jnp.bfloat16, sharding=NamedSharding(
        mesh, logical_to_spec(("batch", "seq", "kv_heads", "head_dim"), rules)))

    def grads(setting):
        def loss(q, k, v):
            impl = attention.choose(setting, dtype=q.dtype, head_dim=q.shape[-1], seq_len=q.shape[1])
            return attention.causal_attention(q, k, v, impl=impl).astype(jnp.float32).sum()

        # Standard promotion: the transpose of jax's own XLA attention mixes float32 and bfloat16 internally, which
        # the suite's strict promotion rejects (jax's code, not ours; the forward is wrapped in attention.py).
        with activate(mesh, rules), jax.numpy_dtype_promotion("standard"):
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile()

    splash, xla = grads("auto"), grads("xla")
    assert "tpu_custom_call" in splash.as_text()
    # Per device: 4 rows x 8 heads of (2048, 2048) scores, at least 256 MiB in bfloat16, for the plain formulation.
    assert xla.memory_analysis().temp_size_in_bytes > 256 * 2**20
    assert splash.memory_analysis().temp_size_in_bytes < 64 * 2**20


@pytest.mark.parametrize("setting, kept", [("splash", (2, 2, 4, 128, 16)), ("xla", (2, 2, 128, 4, 16))])
def test_remat_context_keeps_the_attention_output_once(setting, kept, capsys):
    """remat=context keeps each layer's attention output once: with splash the kernel's own named residual (layers,
    B, H, T, hd, beside its log-sum-exp), not also a (layers, B, T, H, hd) copy under the `context` name (llama-1b-v5e:
    1.2 GiB of temporaries); with XLA's attention the `context`-named (layers, B, T, H, hd) output."""
    import re

    from flax import nnx

    from systolic.workloads.lm.model.config import ModelConfig
    from systolic.workloads.lm.model.transformer import make_model

    cfg = ModelConfig(d_model=64, layers=2, heads=4, kv_heads=2, max_seq_len=128, dtype="float32", scan_layers=True,
                      remat="context", attention=setting)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 128)), jnp.int32)
    graphdef, params = nnx.split(make_model(cfg, 64, 0), nnx.Param)
    capsys.readouterr()
    # JAX's view of what the backward pass keeps, a line a residual: the layer scan's are "f32[2,2,128,64] output of
    # scan ..." (stacked over the layers).
    jax.ad_checkpoint.print_saved_residuals(lambda p: nnx.merge(graphdef, p)(tokens).sum(), params)
    lines = capsys.readouterr().out.splitlines()
    stacked = [tuple(map(int, m[1].split(","))) for m in (re.match(r"\w+\[([\d,]+)\] output of scan", x) for x in lines)
               if m]
    assert [shape for shape in stacked if len(shape) == 5] == [kept], lines
