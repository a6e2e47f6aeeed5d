"""Muon's orthogonalisation against an SVD polar factor and against Optax's, and its transform on 3-D weights."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from systolic.optim import muon


def conditioned(shape, rng, spread=30.0):
    """A random matrix with singular values from 1 down to 1/spread: within reach of five Newton-Schulz steps."""
    u, _, vt = np.linalg.svd(rng.normal(size=shape), full_matrices=False)
    return (u * np.geomspace(1.0, 1.0 / spread, min(shape))) @ vt


def keller_reference(g: np.ndarray) -> np.ndarray:
    """Keller Jordan's `zeropower_via_newtonschulz5` (modded-nanogpt), in float64 NumPy, on a (fan_in, fan_out)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


@pytest.mark.parametrize("shape", [(48, 48), (32, 96), (128, 40)])
def test_orthogonalize_is_the_polar_factor_up_to_singular_values(shape):
    """Same singular vectors as the SVD's polar factor U V^T, singular values in Keller Jordan's band around 1
    (the quintic's coefficients trade convergence for speed), and Keller Jordan's own iteration's numbers."""
    g = conditioned(shape, np.random.default_rng(0))
    o = np.asarray(muon.orthogonalize(jnp.asarray(g, jnp.float32)), np.float64)
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    core = u.T @ o @ vt.T  # diagonal iff o = U D V^T
    off_diagonal = core - np.diag(np.diag(core))
    assert np.abs(off_diagonal).max() < 1e-4
    assert 0.55 < np.diag(core).min() and np.diag(core).max() < 1.25, np.diag(core)
    np.testing.assert_allclose(o, keller_reference(g), atol=2e-5)
    # It is not the exact polar factor: that is the point of the tuned coefficients.
    assert 0.05 < np.linalg.norm(o - u @ vt) / np.linalg.norm(u @ vt) < 0.35


def test_optax_orthogonalization_agrees():
    """Optax's Muon (which we do not use, for its sharding: optim/muon.py) runs the same iteration."""
    from optax.contrib._muon import orthogonalize_via_newton_schulz

    g = jnp.asarray(conditioned((32, 96), np.random.default_rng(1)), jnp.float32)
    theirs = orthogonalize_via_newton_schulz(g, jnp.asarray(muon.NS_COEFFS), muon.NS_STEPS)
    np.testing.assert_allclose(np.asarray(muon.orthogonalize(g)), np.asarray(theirs), atol=1e-5)


def test_three_axis_weights_are_one_matrix_per_projection_and_layers_a_batch():
    """wq (layers, D, H, hd) is orthogonalised as L matrices (D, H*hd); wo (layers, H, hd, D) as L (H*hd, D); the
    update after one step from zero momentum is (1 - beta) G's orthogonal part, Nesterov-mixed, times the shape
    factor (a gradient's scale does not matter: Newton-Schulz starts by normalising)."""
    rng = np.random.default_rng(2)
    grads = {"wq": jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32),
             "wo": jnp.asarray(rng.normal(size=(2, 4, 8, 16)), jnp.float32)}
    dims = {"wq": muon.Dims((-3,), (-2, -1)), "wo": muon.Dims((-3, -2), (-1,))}
    tx = muon.scale_by_muon(lambda tree: {k: dims[k] for k in tree}, momentum=0.9, rule="spectral")
    updates, state = tx.update(grads, tx.init(grads))
    for layer in range(2):
        wq = np.asarray(muon.orthogonalize(grads["wq"][layer].reshape(16, 32)))
        np.testing.assert_allclose(np.asarray(updates["wq"][layer]).reshape(16, 32), wq * np.sqrt(32 / 16), atol=1e-5)
        wo = np.asarray(muon.orthogonalize(grads["wo"][layer].reshape(32, 16)))
        np.testing.assert_allclose(np.asarray(updates["wo"][layer]).reshape(32, 16), wo * np.sqrt(16 / 32), atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.mu["wq"]), 0.1 * np.asarray(grads["wq"]), rtol=1e-6)


def test_shape_scales():
    assert muon.shape_scale(64, 256, "keller") == muon.shape_scale(64, 256, "spectral") == 2.0
    assert muon.shape_scale(256, 64, "keller") == 1.0 and muon.shape_scale(256, 64, "spectral") == 0.5


def test_inside_optax_partition_only_the_matrices_move_by_muon():
    """Masked by optax.partition, the transform sees placeholders for the other parameters and leaves them."""
    params = {"w": jnp.ones((8, 4)), "scale": jnp.ones((4,))}
    grads = {"w": jnp.asarray(np.random.default_rng(3).normal(size=(8, 4)), jnp.float32), "scale": jnp.ones((4,))}
    dims = lambda tree: jax.tree.map(lambda _: muon.Dims((-2,), (-1,)), tree)  # noqa: E731
    tx = optax.partition({"muon": muon.scale_by_muon(dims, momentum=0.95, rule="keller"), "sgd": optax.sgd(1.0)},
                         {"w": "muon", "scale": "sgd"})
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["scale"]), -1.0)
    np.testing.assert_allclose(np.asarray(updates["w"]), np.asarray(muon.orthogonalize(grads["w"])), atol=1e-6)
