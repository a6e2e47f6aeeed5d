"""The integrating factors' exponential (time_stepping.exp) against float64 NumPy: within 1 ulp and unbiased, the
property the TPU's own float32 exp lacks (tests/tpu/test_workload_parity.py checks it on the chip)."""

import jax
import jax.numpy as jnp
import numpy as np

from systolic.workloads.sim.time_stepping import exp


def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got.astype(np.float64) - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)


def test_exp_is_within_one_ulp_and_unbiased_in_float32():
    # A viscous factor's small negative arguments, and the whole normal range on both sides.
    x = np.concatenate([-np.logspace(-8, np.log10(87), 200_001), np.logspace(-8, np.log10(88.5), 200_001)])
    x = x.astype(np.float32)
    err = ulps(np.asarray(jax.jit(exp)(x)), np.exp(x.astype(np.float64)))
    assert np.abs(err).max() <= 1.0
    assert abs(err.mean()) < 0.02
    small = np.abs(x) < 1e-3
    assert abs(err[small].mean()) < 0.02 and np.abs(err[small]).max() <= 0.51  # 1 + x rounds to nearest


def test_exp_limits_dtype_and_derivative():
    out = exp(jnp.array([-100.0, -87.5, 0.0, 100.0], jnp.float32))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), [0.0, 0.0, 1.0, np.inf])
    x = jnp.float32(-0.3)
    np.testing.assert_allclose(jax.grad(lambda v: exp(2 * v))(x), 2 * np.exp(-0.6), rtol=2e-7)
    np.testing.assert_allclose(jax.grad(jax.grad(exp))(x), np.exp(-0.3), rtol=2e-7)
    half = jnp.array([-0.5], jnp.bfloat16)
    assert exp(half).dtype == jnp.bfloat16  # other dtypes take jnp.exp
