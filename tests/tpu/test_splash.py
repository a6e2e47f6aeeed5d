"""The splash kernel on the chip against XLA's attention on the chip and a float32 reference on the host's CPU:
forward and gradients, bfloat16 and float32, head widths 64 and 128, with and without packed documents' segment ids.

Errors are max |got - reference| / max |reference| per output (the forward pass, then dq, dk, dv); the reference is
XLA's formulation on the CPU in float32 at 'highest' matmul precision, fed the same (rounded) inputs. Tolerances:
bfloat16 2e-2 forward and 5e-2 for the gradients (a few bf16 roundings of 2^-8 each: the probabilities are rounded to
bf16 before the value product); float32 2e-3 and 5e-3, which holds also if the kernel's float32 products took bf16
passes (the chip's MXU multiplies bf16; 'highest' asks for six passes). Each error is recorded as a property in
pytest's junit XML (`benchmarks/harness/tpu.sh test` writes it to $OUT/pytest.xml)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.workloads.lm.model import attention

pytestmark = pytest.mark.tpu

B, T, H, KV = 2, 256, 4, 2  # 2 splash blocks of 128: the causal mask skips a block
TOLERANCE = {"bfloat16": (2e-2, 5e-2), "float32": (2e-3, 5e-3)}  # (forward, gradients), relative to the max


def _inputs(head_dim: int, dtype: str, segmented: bool):
    rng = np.random.default_rng(head_dim)
    q = rng.standard_normal((B, T, H, head_dim), np.float32)
    k, v = (rng.standard_normal((B, T, KV, head_dim), np.float32) for _ in range(2))
    d_out = rng.standard_normal((B, T, H, head_dim), np.float32)  # a cotangent that weights every output
    cast = [np.asarray(jnp.asarray(a, dtype)) for a in (q, k, v, d_out)]  # rounded once, on the host
    # Two documents a row, split at positions 100 and 200 (inside splash blocks).
    ids = (np.arange(T)[None, :] >= np.array([[100], [200]])).astype(np.int32) if segmented else None
    return cast, ids


def _value_and_grads(impl: str):
    def f(q, k, v, d_out, segment_ids):
        out, pullback = jax.vjp(lambda *a: attention.causal_attention(*a, impl=impl, segment_ids=segment_ids), q, k, v)
        return out, pullback(d_out)

    return jax.jit(f)


def _run(impl: str, device: jax.Device, arrays, ids, dtype: str):
    arrays = [jax.device_put(jnp.asarray(a, dtype), device) for a in arrays]
    ids = None if ids is None else jax.device_put(ids, device)
    # Standard promotion, as users run: jax's XLA attention adds float32 statistics to bfloat16 scores, and its
    # backward pass is traced outside the forward's own `numpy_dtype_promotion("standard")`. 'highest' only for
    # float32: the splash kernel's bfloat16 dots refuse an fp32 contract precision (Mosaic: "Bad lhs type", seen on
    # the chip), and bfloat16 operands take one pass anyway.
    precision = "highest" if dtype == "float32" else "default"
    with jax.default_matmul_precision(precision), jax.numpy_dtype_promotion("standard"):
        out, grads = _value_and_grads(impl)(*arrays, ids)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


@pytest.mark.parametrize("segmented", [False, True], ids=["causal", "segments"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_splash_on_the_chip_matches_xla_attention(chip, host, dtype, head_dim, segmented, record_property):
    arrays, ids = _inputs(head_dim, dtype, segmented)
    reference = _run("xla", host, arrays, ids, "float32")
    results = {impl: _run(impl, chip, arrays, ids, dtype) for impl in ("splash", "xla")}
    fwd_tol, grad_tol = TOLERANCE[dtype]
    errors = {}
    for impl, got in results.items():
        for name, a, ref in zip(("out", "dq", "dk", "dv"), got, reference):
            errors[f"{impl} {name}"] = float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))
    for name, error in errors.items():
        record_property(name, f"{error:.2e}")
    too_far = {n: e for n, e in errors.items() if e > (fwd_tol if n.endswith("out") else grad_tol)}
    assert not too_far, f"{dtype}, head_dim {head_dim}: over ({fwd_tol}, {grad_tol}): {too_far}; all: {errors}"
