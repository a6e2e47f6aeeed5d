"""Document packing (`data.packing=documents`): the host's segment ids and positions against a plain Python loop,
the packed model against each document run on its own (every attention implementation, both position embeddings),
and the option end to end through the CLI."""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding

from systolic import config as config_lib
from systolic.cli import main
from systolic.data import text
from systolic.errors import ConfigError
from systolic.runtime.sharding import RULE_SETS, activate, logical_to_spec
from systolic.workloads.lm.model import attention
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.transformer import Transformer
from tiny import LM_CLI_QUIET, TINY_LM

EOT = 9


def reference_segments(row: list[int], eot: int) -> tuple[list[int], list[int]]:
    """Segment and position of each token, one at a time: an end-of-document token opens the next document."""
    segment, position, segments, positions = 0, 0, [], []
    for token in row:
        if token == eot:
            segment, position = segment + 1, 0
        segments.append(segment)
        positions.append(position)
        position += 1
    return segments, positions


def test_segments_and_positions_match_a_python_loop():
    rows = np.array([
        [5, 6, 9, 7, 8, 1, 9, 2],  # a cut document, then two that start with their end-of-document opener
        [9, 1, 2, 3, 4, 5, 6, 7],  # the window starts on a boundary: segment 0 is empty
        [1, 2, 3, 4, 5, 6, 7, 8],  # one document across the whole window
        [9, 9, 3, 9, 9, 9, 4, 9],  # empty documents, and a window that ends on an opener
    ])
    segment_ids, positions = text.document_segments(rows, EOT)
    assert segment_ids.dtype == positions.dtype == np.int32
    for row, got_segments, got_positions in zip(rows, segment_ids, positions):
        want_segments, want_positions = reference_segments(row.tolist(), EOT)
        assert got_segments.tolist() == want_segments and got_positions.tolist() == want_positions

    # Through the batch functions: targets are the inputs shifted by one, whatever the packing.
    tokens = rows.reshape(-1)  # 32 tokens: 3 windows of 8 + 1
    packed = text.make_eval_batches(tokens, seq_len=8, batch=3, num_batches=1, eot_id=EOT)[0]
    concat = text.make_eval_batches(tokens, seq_len=8, batch=3, num_batches=1)[0]
    assert tuple(packed) == text.batch_keys(packed=True) and tuple(concat) == text.batch_keys(packed=False)
    for key in concat:
        np.testing.assert_array_equal(packed[key], concat[key])
    for row, got_segments, got_positions in zip(packed["inputs"], packed["segment_ids"], packed["positions"]):
        assert (got_segments.tolist(), got_positions.tolist()) == reference_segments(row.tolist(), EOT)


# THE MODEL ----------------------------------------------------------------------------------------------------

T = 128  # one splash block
VOCAB = 64
# Lengths of the segments in each row, each segment but a row's first opened by EOT. Row 0 starts inside a
# document; row 1 starts on an opener (its segment 0 is empty) and holds a 1-token document.
SEGMENTS = [[23, 40, 7, 58], [0, 1, 90, 37]]


def packed_rows() -> np.ndarray:
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, VOCAB, (len(SEGMENTS), T)).astype(np.int32)  # (B, T), no EOT
    for row, lengths in zip(tokens, SEGMENTS):
        assert sum(lengths) == T
        row[np.cumsum(lengths)[:-1]] = EOT
    return tokens


def model_config(family: str, setting: str):
    tiny = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, TINY_LM)).model
    # A wide init: with the default 0.02 a leak across documents would move the logits by less than the tolerance.
    return dataclasses.replace(tiny, family=family, attention=setting, max_seq_len=T, dtype="float32", init_std=0.3)


def _logits(model: Transformer, tokens, segment_ids, positions) -> np.ndarray:
    graphdef, params = nnx.split(model)
    return np.asarray(_forward(graphdef, params, jnp.asarray(tokens), segment_ids, positions))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens, segment_ids, positions):
    return nnx.merge(graphdef, params)(tokens, segment_ids=segment_ids, positions=positions)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_logits_equal_each_document_run_alone(family):
    tokens = packed_rows()
    segment_ids, positions = text.document_segments(tokens, EOT)  # (B, T) each

    # Each segment alone, at positions from 0, as a row of its own: causal attention makes the padding after it
    # invisible to it, so one batch runs every segment alone.
    starts = [(b, start, n) for b, lengths in enumerate(SEGMENTS)
              for start, n in zip(np.cumsum([0, *lengths[:-1]]), lengths) if n]
    alone = np.zeros((len(starts), T), np.int32)
    for i, (b, start, n) in enumerate(starts):
        alone[i, :n] = tokens[b, start : start + n]
    reference = Transformer(model_config(family, "xla"), VOCAB, rngs=nnx.Rngs(0))
    want = _logits(reference, alone, None, None)  # (segments, T, V)

    unpacked = _logits(reference, tokens, None, None)
    assert not np.allclose(unpacked[0, 30], want[1, 30 - 23], atol=1e-2), "documents that see each other must differ"

    assert attention.choose("auto", dtype=jnp.float32, head_dim=8, seq_len=T) == "cpu"
    for setting in ("xla", "auto", "splash"):  # auto: the cpu formulation
        model = Transformer(model_config(family, setting), VOCAB, rngs=nnx.Rngs(0))  # the same parameters
        got = _logits(model, tokens, jnp.asarray(segment_ids), jnp.asarray(positions))
        for i, (b, start, n) in enumerate(starts):
            np.testing.assert_allclose(got[b, start : start + n], want[i, :n], atol=1e-4, rtol=1e-4,
                                       err_msg=f"{setting}: row {b}, the segment at {start}")


def test_attention_gradients_within_segments_agree_across_implementations():
    """The backward passes (splash's kernel, the cpu formulation's hand-written one) with segment ids, and splash
    per shard under a mesh (its shard_map splits the ids by rows)."""
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(0), 4)
    B, H, KV, hd = 2, 4, 2, 64
    q = jax.random.normal(kq, (B, T, H, hd))
    k, v = jax.random.normal(kk, (B, T, KV, hd)), jax.random.normal(kv, (B, T, KV, hd))
    d_out = jax.random.normal(kd, (B, T, H, hd))
    segment_ids = jnp.asarray(text.document_segments(packed_rows(), EOT)[0])

    def value_and_grads(impl):
        def f(q, k, v):
            return attention.causal_attention(q, k, v, impl=impl, segment_ids=segment_ids)

        out, pullback = jax.vjp(f, q, k, v)
        return out, pullback(d_out)

    want_out, want_grads = jax.jit(value_and_grads, static_argnums=0)("xla")
    results = {impl: jax.jit(value_and_grads, static_argnums=0)(impl) for impl in ("cpu", "splash")}
    # 4 of the 8 devices: the batch of 2 over fsdp, the 4 query and 2 key/value heads over tensor.
    mesh = jax.make_mesh((1, 1, 2, 1, 1, 2), ("data", "stage", "fsdp", "expert", "context", "tensor"), axis_types=(AxisType.Auto,) * 6,
                         devices=jax.devices()[:4])
    rules = RULE_SETS["default"]
    q = jax.device_put(q, NamedSharding(mesh, logical_to_spec(("batch", "seq", "heads", "head_dim"), rules)))
    with activate(mesh, rules):
        results["splash under a mesh"] = jax.jit(value_and_grads, static_argnums=0)("splash")
    for impl, (out, grads) in results.items():
        np.testing.assert_allclose(out, want_out, atol=2e-5, err_msg=impl)
        for name, got, want in zip("qkv", grads, want_grads):
            np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5, err_msg=f"{impl}: d{name}")


def test_cudnn_takes_packed_documents_only_at_an_even_length(monkeypatch):
    # jax hands cuDNN the documents' mask as an additive bias, which its training kernel takes for even lengths only.
    monkeypatch.setattr(attention, "compile_platform", lambda: "gpu")
    monkeypatch.setattr(attention, "device_platform", lambda: "gpu")
    choose = functools.partial(attention.choose, dtype=jnp.bfloat16, head_dim=64, segments=True)
    assert (choose("auto", seq_len=256), choose("auto", seq_len=255)) == ("cudnn", "xla")
    assert choose("cudnn", seq_len=256) == "cudnn"
    with pytest.raises(ConfigError, match=r"data.packing=documents.*data.seq_len=255. Fix: an even data.seq_len"):
        choose("cudnn", seq_len=255)
    assert attention.choose("cudnn", dtype=jnp.bfloat16, head_dim=64, seq_len=255) == "cudnn"  # one document a row


def test_cudnn_call_takes_the_documents_mask_as_a_bias_forward_and_backward(monkeypatch):
    """No GPU here: trace (not compile) the cudnn path, with jax's cuDNN version probe stubbed, to check that jax
    accepts the call and hands the kernel the (B, 1, T, T) mask as a bias in both directions."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    B, H, KV, hd = 2, 4, 2, 64
    q, kv = jnp.zeros((B, T, H, hd), jnp.bfloat16), jnp.zeros((B, T, KV, hd), jnp.bfloat16)
    segment_ids = jnp.asarray(text.document_segments(packed_rows(), EOT)[0])

    def loss(q, k, v):
        return attention.causal_attention(q, k, v, impl="cudnn", segment_ids=segment_ids).astype(jnp.float32).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv).jaxpr
    kernels = {str(e.primitive): str(e.invars[3].aval)  # the operands: q, k, v, bias, ...
               for e in jaxpr.eqns if "dot_product_attention" in str(e.primitive)}
    assert kernels == {f"dot_product_attention_{d}_wrapper": f"bfloat16[{B},1,{T},{T}]" for d in ("fwd", "bwd")}


# END TO END ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> Path:
    """A .jsonl of 300 documents of 1-4 lines of Python: most windows of 16 tokens hold a document boundary."""
    import textwrap as stdlib_module

    lines = [line for line in Path(stdlib_module.__file__).read_text().splitlines() if line.strip()]
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("short") / "docs.jsonl"
    with path.open("w") as f:
        at = 0
        for _ in range(300):
            n = int(rng.integers(1, 5))
            f.write(json.dumps({"text": "\n".join(lines[at : at + n])}) + "\n")
            at = (at + n) % (len(lines) - 4)
    return path


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def test_training_on_packed_documents_differs_from_concat_and_resumes_exactly(short_documents, tmp_path):
    train = ["train", "lm", *TINY_LM, *LM_CLI_QUIET, f"data.path={short_documents}", "data.max_bytes=0",
             "observe.log_every=1", "-q"]
    packed = [*train, "data.packing=documents"]
    assert main([*train, "--run-dir", str(tmp_path / "concat")]) == 0
    assert main([*packed, "--run-dir", str(tmp_path / "whole")]) == 0
    assert main([*packed, "loop.stop_at_step=4", "--run-dir", str(tmp_path / "resumed")]) == 0
    assert main([*packed, "--run-dir", str(tmp_path / "resumed")]) == 0
    concat, whole, resumed = (_losses(tmp_path / name) for name in ("concat", "whole", "resumed"))
    assert sorted(whole) == list(range(1, 11)) and resumed == whole
    # The same windows in the same order: only the attention and the positions differ.
    assert whole[1] != concat[1] and all(np.isfinite(list(whole.values())))


def test_an_unknown_packing_is_one_paragraph_and_exit_2(capsys):
    assert main(["train", "lm", *TINY_LM, "data.packing=foo", "-q"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "data.packing='foo' is not allowed" in err and "concat, documents" in err and "Traceback" not in err
