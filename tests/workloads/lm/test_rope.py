"""RoPE's rotate-half as a signed permutation product (lm/model/rope.py) against the sliced formula in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.workloads.lm.model import rope


def reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Hugging Face Llama's x*cos + rotate_half(x)*sin over the first d_rope dimensions, float64."""
    d_rope = cos.shape[-1]
    h, rest = x[..., :d_rope], x[..., d_rope:]
    x1, x2 = np.split(h, 2, axis=-1)
    out = h * cos[:, :, None] + np.concatenate([-x2, x1], axis=-1) * sin[:, :, None]
    return np.concatenate([out, rest], axis=-1)


@pytest.mark.parametrize("d_rope", [64, 32])  # whole heads, and Phi-4-mini's partial rotation
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_apply_rope_equals_the_sliced_formula(d_rope, dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 16, 4, 64)) * 3, dtype)
    angles = np.arange(16.0)[None, :, None] * np.linspace(0.01, 1.0, d_rope // 2)  # (1, T, d_rope/2)
    angles = np.concatenate([angles, angles], axis=-1)
    tables = (jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32))
    got = np.asarray(rope.apply_rope(x, tables), np.float64)
    want = reference(np.asarray(x, np.float64), np.cos(angles), np.sin(angles))
    # float32 arithmetic on exact inputs: within float32 rounding of the float64 result (bfloat16: its output rounding)
    np.testing.assert_allclose(got, want, rtol=0, atol=(1e-5 if dtype == "float32" else 0.07))
    # The rotated half itself is exact: one nonzero per column of the permutation.
    turned = jnp.einsum("btnd,de->btne", x.astype(jnp.float32), rope._half_turn(64, d_rope),
                        precision=jax.lax.Precision.HIGHEST)
    half = d_rope // 2
    xs = np.asarray(x, np.float32)
    expected = np.concatenate([-xs[..., half:d_rope], xs[..., :half], np.zeros_like(xs[..., d_rope:])], axis=-1)
    np.testing.assert_array_equal(np.asarray(turned), expected)
