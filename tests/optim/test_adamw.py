"""optim/adamw.py's `scale_by_adam`: optax's numbers with the moments stored as the parameters, a float64 NumPy
Adam's within bfloat16 rounding with bfloat16 moments; and Muon's momentum in bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from systolic.optim import muon
from systolic.optim.adamw import scale_by_adam

B1, B2, EPS = 0.9, 0.95, 1e-8
STEPS = 6


def gradients(seed: int = 0) -> list[dict]:
    """STEPS gradients of a (64, 32) matrix and a (32,) vector, on different scales (as a real model's are)."""
    rng = np.random.default_rng(seed)
    return [{"w": rng.normal(size=(64, 32)) * 1e-3, "b": rng.normal(size=(32,)) * 10.0} for _ in range(STEPS)]


def adam_reference(grads: list[dict]) -> tuple[list[dict], dict, dict, dict]:
    """Adam's scaled steps (before the learning rate) in float64 NumPy, the final moments, and the sums of their
    magnitudes over the steps (each step's rounding to bfloat16 errs by at most 2^-9 of the value it rounds, and
    the moments carry the earlier errors on, decayed: the sum bounds what they can add up to)."""
    zeros = lambda: {k: np.zeros_like(v) for k, v in grads[0].items()}  # noqa: E731
    mu, nu, mu_sum, nu_sum = zeros(), zeros(), zeros(), zeros()
    steps = []
    for t, g in enumerate(grads, start=1):
        mu = {k: B1 * mu[k] + (1 - B1) * g[k] for k in g}
        nu = {k: B2 * nu[k] + (1 - B2) * g[k] ** 2 for k in g}
        mu_sum = {k: mu_sum[k] + np.abs(mu[k]) for k in g}
        nu_sum = {k: nu_sum[k] + nu[k] for k in g}
        steps.append({k: (mu[k] / (1 - B1**t)) / (np.sqrt(nu[k] / (1 - B2**t)) + EPS) for k in g})
    return steps, mu, nu, {"mu": mu_sum, "nu": nu_sum}


def run(tx, grads: list[dict], dtype=jnp.float32) -> tuple[list[dict], object]:
    cast = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)  # noqa: E731
    state = tx.init(cast(grads[0]))
    update = jax.jit(tx.update)
    steps = []
    with jax.numpy_dtype_promotion("standard"):
        for g in grads:
            step, state = update(cast(g), state)
            steps.append(jax.tree.map(lambda x: np.asarray(x, np.float64), step))
    return steps, state


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_moments_as_the_parameters_are_optax_adam_bit_for_bit(dtype):
    """With the moments stored as the parameters (float32 for the lm; float64 for `fit sim` under x64) the transform
    is optax.scale_by_adam: same steps, same state tree (so older checkpoints, saved by optax.adamw, restore)."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", dtype == "float64")
    try:
        grads = gradients()
        ours, ours_state = run(scale_by_adam(b1=B1, b2=B2, eps=EPS), grads, dtype)
        theirs, theirs_state = run(optax.scale_by_adam(b1=B1, b2=B2, eps=EPS), grads, dtype)
    finally:
        jax.config.update("jax_enable_x64", previous)
    assert jax.tree.structure(ours_state) == jax.tree.structure(theirs_state)
    assert {x.dtype for x in jax.tree.leaves((ours_state.mu, ours_state.nu))} == {np.dtype(dtype)}
    for a, b in zip(jax.tree.leaves((ours, ours_state)), jax.tree.leaves((theirs, theirs_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_moments_follow_float64_adam_within_their_rounding():
    """The moments are stored in bfloat16 (8 significant bits: a relative rounding of at most 2^-9 a step) and
    the steps stay within a few such roundings of float64 Adam's; float32 storage is 100x closer."""
    grads = gradients()
    ref_steps, ref_mu, ref_nu, sums = adam_reference(grads)
    steps16, state16 = run(scale_by_adam(b1=B1, b2=B2, eps=EPS, moment_dtype=jnp.bfloat16), grads)
    steps32, _ = run(scale_by_adam(b1=B1, b2=B2, eps=EPS, moment_dtype=jnp.float32), grads)
    assert {x.dtype for x in jax.tree.leaves((state16.mu, state16.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert state16.count.dtype == jnp.int32 and int(state16.count) == STEPS
    # The stored moments: float64's, give or take every step's rounding (twice the bound, for float32 arithmetic).
    for k in ("w", "b"):
        for name, stored, ref in (("mu", state16.mu[k], ref_mu[k]), ("nu", state16.nu[k], ref_nu[k])):
            err = np.abs(np.asarray(stored, np.float64) - ref)
            assert (err <= 2**-8 * sums[name][k]).all(), (k, name, (err / sums[name][k]).max())
            assert err.max() > 0
    # Adam's steps are about +-1 whatever the gradient's scale: compare them on that scale.
    for t in range(STEPS):
        for k in ("w", "b"):
            err16 = np.abs(steps16[t][k] - ref_steps[t][k]).max()
            err32 = np.abs(steps32[t][k] - ref_steps[t][k]).max()
            assert err16 < 2e-2 and err32 < 1e-5, (t, k, err16, err32)
            assert t == 0 or err16 > 100 * err32  # bfloat16 storage really acted (step 0 reads zero moments)


def test_muon_momentum_in_bfloat16_is_the_float32_momentum_rounded():
    """Muon's stored momentum is bfloat16; its update after two steps is float32 Muon's within that rounding."""
    rng = np.random.default_rng(4)
    grads = [{"w": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)} for _ in range(2)]
    dims = lambda tree: jax.tree.map(lambda _: muon.Dims((-2,), (-1,)), tree)  # noqa: E731
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        tx = muon.scale_by_muon(dims, momentum=0.95, rule="keller", moment_dtype=dtype)
        state = tx.init(grads[0])
        for g in grads:
            update, state = tx.update(g, state)
        out[dtype] = update["w"], state.mu["w"]
    (u32, m32), (u16, m16) = out[jnp.float32], out[jnp.bfloat16]
    assert m16.dtype == jnp.bfloat16 and m32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(m16, np.float32), np.asarray(m32), atol=2**-8 * float(jnp.abs(m32).max()))
    assert not np.array_equal(np.asarray(m16, np.float32), np.asarray(m32))
    np.testing.assert_allclose(np.asarray(u16), np.asarray(u32), atol=2e-2 * float(jnp.abs(u32).max()))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_moments_keep_their_dtype_and_sharding_on_8_devices(dtype):
    """init and update on a parameter split over 8 fake devices: the moments are laid out as the parameter, in
    their dtype. (The lm's step, with its shardings given, compiles once: tests/workloads/lm/test_moment_dtype.py.)"""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.NamedSharding(mesh, jax.P("fsdp", None))
    params = {"w": jax.device_put(jnp.ones((64, 16), jnp.float32), sharding)}
    tx = scale_by_adam(b1=B1, b2=B2, eps=EPS, moment_dtype=dtype)
    state = jax.jit(tx.init)(params)
    update = jax.jit(tx.update)
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(2):
            _, state = update(params, state)
    for moment in (state.mu["w"], state.nu["w"]):
        assert moment.dtype == dtype and moment.sharding.is_equivalent_to(sharding, 2)
