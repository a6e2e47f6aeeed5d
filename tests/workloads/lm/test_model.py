"""The transformer against a float64 NumPy reference, across layouts (scan/list), remat and sharding."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from systolic.engine.state import param_count
from systolic.runtime.sharding import activate, named_sharding
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.layers import resolve_dtype
from systolic.workloads.lm.model.transformer import make_model

VOCAB = 64
LLAMA = ModelConfig(family="llama", d_model=32, layers=2, heads=4, kv_heads=2, mlp_dim=64, max_seq_len=16, dtype="float32")
GPT2 = ModelConfig(family="gpt2", d_model=32, layers=2, heads=4, max_seq_len=16, tie_embeddings=True, dtype="float32")
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 12)), jnp.int32)


def graphdef_of(cfg: ModelConfig) -> nnx.GraphDef:
    return nnx.graphdef(nnx.eval_shape(lambda: make_model(cfg, VOCAB, 0)))


def random_params(cfg: ModelConfig, seed: int = 0, std: float = 0.2):
    """Float32 params as a pure dict, the same values for the list and the scan layout. NumPy draws them:
    jax.random under jit compiles slowly on CPU, and non-zero biases and non-unit norm scales make the
    reference test check that they are used."""
    abstract = nnx.state(nnx.eval_shape(lambda: make_model(dataclasses.replace(cfg, scan_layers=False), VOCAB, 0)), nnx.Param)
    rng = np.random.default_rng(seed)

    def draw(path, x):
        noise = rng.normal(0.0, std, x.shape)
        return jnp.asarray(1.0 + noise if path[-1].key == "scale" else noise, jnp.float32)

    params = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(abstract))
    if cfg.scan_layers:  # block params stacked on a leading `layers` axis
        params["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[params["blocks"][i] for i in range(cfg.layers)])
    return params


@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


def reference_logits(cfg: ModelConfig, p, tokens) -> np.ndarray:
    """The same network in float64 NumPy, written from the papers' equations (list layout params)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    tokens = np.asarray(tokens)
    T, hd = tokens.shape[1], cfg.d_head

    def norm(x, n):
        if cfg.family == "llama":
            return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + cfg.norm_eps) * n["scale"]
        x = x - x.mean(-1, keepdims=True)
        return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + cfg.norm_eps) * n["scale"] + n["bias"]

    def rope(x):  # rotate-half: dimension i pairs with i + hd/2
        angle = np.arange(T)[:, None] * cfg.rope_theta ** (-np.arange(0, hd, 2) / hd)  # (T, hd/2)
        c, s = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    x = p["embed"][tokens]
    if cfg.family == "gpt2":
        x = x + p["pos_embed"][:T]
    for i in range(cfg.layers):
        b = p["blocks"][i]
        a, h = b["attn"], norm(x, b["attn_norm"])
        q, k, v = (np.einsum("btd,dnh->btnh", h, a[w]) for w in ("wq", "wk", "wv"))
        if cfg.family == "gpt2":
            q, k, v = q + a["bq"], k + a["bk"], v + a["bv"]
        else:
            q, k = rope(q), rope(k)
        group = cfg.heads // cfg.n_kv_heads  # query head n reads key/value head n // group
        k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
        scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(hd)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out = np.einsum("bnts,bsnh->btnh", w / w.sum(-1, keepdims=True), v)
        x = x + np.einsum("btnh,nhd->btd", out, a["wo"]) + (a["bo"] if cfg.family == "gpt2" else 0)
        m, h = b["mlp"], norm(x, b["mlp_norm"])
        if cfg.family == "llama":
            g = h @ m["w_gate"]
            x = x + (g / (1 + np.exp(-g)) * (h @ m["w_up"])) @ m["w_down"]
        else:
            u = h @ m["w_fc"] + m["b_fc"]
            u = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
            x = x + u @ m["w_proj"] + m["b_proj"]
    x = norm(x, p["final_norm"])
    return x @ (p["embed"].T if cfg.tie_embeddings else p["lm_head"])


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama-gqa", "gpt2-tied"])
def test_forward_matches_numpy_reference(cfg):
    params = random_params(cfg)
    logits = forward(graphdef_of(cfg), params, TOKENS)
    assert logits.shape == (2, 12, VOCAB) and logits.dtype == jnp.float32
    want = reference_logits(cfg, params, TOKENS)
    assert np.abs(want).max() > 1.0  # the weights are large enough for the check to mean something
    np.testing.assert_allclose(logits, want, atol=2e-4, rtol=2e-4)
    assert ("lm_head" in params) != cfg.tie_embeddings


# Parameter counts written out by hand for the two tiny configs (vocabulary V=64, d=32, 2 layers, 4 heads of 8),
# as transformers' LlamaForCausalLM / GPT2LMHeadModel of the same shape count them.
LLAMA_PARAMS = (64 * 32  # token embedding
                + 2 * (32 * 4 * 8 + 2 * 32 * 2 * 8 + 4 * 8 * 32  # wq; wk and wv (2 kv heads); wo
                       + 3 * 32 * 64  # SwiGLU gate, up (d -> 64) and down
                       + 2 * 32)  # two RMSNorm scales
                + 32  # final RMSNorm
                + 32 * 64)  # untied lm_head
GPT2_PARAMS = (64 * 32 + 16 * 32  # token and position embeddings (max_seq_len=16); the lm_head is the embedding
               + 2 * (32 * 3 * 32 + 3 * 32 + 32 * 32 + 32  # q, k, v and out projections with biases
                      + 32 * 128 + 128 + 128 * 32 + 32  # MLP d -> 4d -> d with biases
                      + 2 * 2 * 32)  # two LayerNorms, scale and bias
               + 2 * 32)  # final LayerNorm


@pytest.mark.parametrize("cfg, want", [(LLAMA, LLAMA_PARAMS), (GPT2, GPT2_PARAMS)], ids=["llama-gqa", "gpt2-tied"])
def test_param_count_matches_the_hand_count(cfg, want):
    assert param_count(random_params(cfg)) == want


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_scan_layers_matches_list(cfg):
    scan_cfg = dataclasses.replace(cfg, scan_layers=True)
    scanned = random_params(scan_cfg)
    assert scanned["blocks"]["attn"]["wq"].shape == (cfg.layers, 32, 4, 8)
    np.testing.assert_allclose(
        forward(graphdef_of(scan_cfg), scanned, TOKENS), forward(graphdef_of(cfg), random_params(cfg), TOKENS), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("remat,scan", [("full", False), ("dots", True)])
def test_remat_same_logits_and_grads(remat, scan):
    cfg = dataclasses.replace(LLAMA, scan_layers=scan)
    params = random_params(cfg)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12, VOCAB)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_grad(graphdef, params):
        return jax.value_and_grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(TOKENS) * weights))(params)

    want, want_grads = value_and_grad(graphdef_of(cfg), params)
    got, got_grads = value_and_grad(graphdef_of(dataclasses.replace(cfg, remat=remat)), params)
    # Recomputation changes XLA's fusion and so float32 rounding: compare at float32 tolerance, not bitwise.
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4), got_grads, want_grads)


def test_bfloat16_compute_close_to_float32():
    params = random_params(LLAMA)
    want = forward(graphdef_of(LLAMA), params, TOKENS)
    got = forward(graphdef_of(dataclasses.replace(LLAMA, dtype="bfloat16")), params, TOKENS)
    assert got.dtype == jnp.float32
    assert float(jnp.abs(got - want).max()) < 0.05 * float(jnp.abs(want).max())
    assert resolve_dtype("auto") == jnp.float32  # tests run on CPU


def test_sharded_creation_and_forward():
    cfg = dataclasses.replace(LLAMA, scan_layers=True, remat="full")
    mesh = jax.make_mesh((2, 1, 2, 1, 1, 2), ("data", "stage", "fsdp", "expert", "context", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 6)
    tokens = jnp.concatenate([TOKENS, TOKENS[:, ::-1]])  # batch 4 splits over data x fsdp
    # Non-partitionable threefry compiles ~3x faster on CPU; the layout comes from the annotations either way.
    with activate(mesh), jax.threefry_partitionable(False):
        graphdef = graphdef_of(cfg)
        params = jax.jit(lambda: nnx.state(make_model(cfg, VOCAB, 0), nnx.Param))()
        sharded_logits = forward(graphdef, params, tokens)
    expected = {
        ("embed",): ("vocab", "embed"),
        ("lm_head",): ("embed", "vocab"),
        ("blocks", "attn", "wq"): ("layers", "embed", "heads", "head_dim"),
        ("blocks", "attn", "wk"): ("layers", "embed", "kv_heads", "head_dim"),
        ("blocks", "mlp", "w_down"): ("layers", "mlp", "embed"),
    }
    for path, names in expected.items():
        value = nnx.to_pure_dict(params)
        for name in path:
            value = value[name]
        assert value.sharding.is_equivalent_to(named_sharding(mesh, names), value.ndim), (path, value.sharding.spec)
    assert len(sharded_logits.sharding.device_set) == 8
    host_params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), nnx.to_pure_dict(params))
    np.testing.assert_allclose(sharded_logits, forward(graphdef, host_params, tokens), atol=1e-5, rtol=1e-5)


def test_the_remat_vocabulary_is_written_once():
    """model.remat's names come from one table: the config accepts exactly them, each has a policy (the MLP-keeping
    ones save by jax's own rule, the rest by remat.KEEPS), and `plan --search` tries a subset in the same order."""
    import typing

    from systolic.workloads.lm.commands import WORKLOAD
    from systolic.workloads.lm.model import remat
    from systolic.workloads.lm.model.config import REMAT_POLICIES, REMATS

    assert typing.get_args(typing.get_type_hints(ModelConfig)["remat"]) == REMATS == tuple(REMAT_POLICIES)
    assert set(remat.KEEPS) | {"none", "dots"} == set(REMATS)
    searched = WORKLOAD.plan_search.remats
    assert set(searched) <= set(REMATS) and list(searched) == sorted(searched, key=REMATS.index)
