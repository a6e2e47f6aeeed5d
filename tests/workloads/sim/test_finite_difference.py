"""Finite differences: halo exchange against a single-array reference, second-order convergence on the heat
equation against its exact solution."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.workloads.sim import finite_difference as fd
from systolic.workloads.sim.solver import make_blocks, make_simulation

pytestmark = pytest.mark.usefixtures("x64")


def reference_laplacian(f, dx):
    """5-point periodic Laplacian of the whole grid with np.roll."""
    return (np.roll(f, 1, -2) + np.roll(f, -1, -2) + np.roll(f, 1, -1) + np.roll(f, -1, -1) - 4 * f) / dx**2


@pytest.mark.parametrize("layout", ["1 device", "data=8", "2x2x2"])
def test_halo_exchange_laplacian_matches_the_whole_grid(layout, mesh_of, sim_config):
    mesh = mesh_of(layout)
    blocks = make_blocks(sim_config("grid.n=16", "sim.equation=heat"), mesh)
    f = np.random.default_rng(0).normal(size=(2, 16, 16))
    spec = jax.P(None, *blocks.spec)
    lap = jax.jit(jax.shard_map(lambda x: fd.laplacian(x, blocks, 0.5), mesh=mesh, in_specs=spec, out_specs=spec))
    out = np.asarray(lap(jnp.asarray(f)))
    # Sums in the same order as the reference's x-then-y pairs, so equal to rounding only.
    np.testing.assert_allclose(out, reference_laplacian(f, 0.5), rtol=0, atol=1e-12)


def test_exchange_sends_edges_to_ring_neighbours(mesh_of):
    mesh = mesh_of("data=8")
    rows = jnp.arange(8.0)[:, None] * jnp.ones((1, 3))  # device i holds one row of value i
    padded = jax.jit(jax.shard_map(lambda x: fd.exchange_halo(x, 0, ("data",), 8), mesh=mesh,
                                   in_specs=jax.P("data"), out_specs=jax.P("data")))(rows)
    got = np.asarray(padded)[:, 0].reshape(8, 3)  # per device: (lower halo, own row, upper halo)
    np.testing.assert_array_equal(got, [[(i - 1) % 8, i, (i + 1) % 8] for i in range(8)])


def test_heat_equation_converges_at_second_order(sim_config, mesh_of):
    """u0 = sin(x + 0.5) sin(2y + 0.25), D = 0.1, t = 0.5: the relative L2 error against u0 exp(-5 D t) falls 4x
    per doubling of n. dt = 32 / n^2 keeps dt / dx^2 fixed (D dt / dx^2 = 0.08), so Euler's O(dt) error is
    O(dx^2) like the Laplacian's and the ratio between the two does not change with n."""
    errors = []
    for n in (16, 32, 64):
        cfg = sim_config(f"grid.n={n}", "sim.equation=heat", "sim.t_end=0.5", "output.frames=1", f"sim.dt={32 / n**2}",
                         "sim.dtype=float64")
        sim = make_simulation(cfg, mesh_of("data=8"))
        _, metrics = sim.frame_step(sim.initial_state(), None)
        errors.append(float(metrics["error"]))
    orders = [math.log2(a / b) for a, b in zip(errors, errors[1:])]
    assert all(1.9 < p < 2.1 for p in orders), (errors, orders)
