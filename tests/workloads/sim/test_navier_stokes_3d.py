"""The 3-D spectral solver against exact solutions (the ABC flow's viscous decay, a divergence-free Taylor-Green,
inviscid energy conservation), the same fields on every mesh with only all-to-all transposes, and gradients
through a short run against finite differences."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.workloads.sim import navier_stokes_3d as ns3
from systolic.workloads.sim.pencil import make_pencil
from systolic.workloads.sim.solver import make_simulation

pytestmark = pytest.mark.usefixtures("x64")

FLOW = ("sim.equation=navier_stokes_3d", "grid.n=16", "sim.dtype=float64")


def run(cfg, mesh):
    """(the final velocity field, the last frame's metrics, the simulation)."""
    sim = make_simulation(cfg, mesh)
    state = sim.initial_state()
    for _ in range(cfg.output.frames):
        state, metrics = sim.frame_step(state, None)
    return np.asarray(state.params["u_hat"]), jax.device_get(metrics), sim, state


# EXACT SOLUTIONS ----------------------------------------------------------------------------------------------


def test_abc_flow_decays_at_the_viscous_rate(sim_config, mesh_of):
    """A Beltrami field (w = k u) makes u x w vanish, so u(t) = u(0) exp(-nu k^2 t) exactly: relative error
    <= 1e-13 in float64 after 1 time unit of CFL steps on a 2x2 mesh (measured ~1e-15)."""
    cfg = sim_config(*FLOW, "navier_stokes_3d.initial=abc", "navier_stokes_3d.initial_wavenumber=2",
                     "navier_stokes_3d.viscosity=0.05", "sim.t_end=1.0", "output.frames=2")
    u_hat, metrics, _, _ = run(cfg, mesh_of("2x2"))
    n, k, t = 16, 2.0, 1.0
    x = np.arange(n) * 2 * np.pi / n
    X, Y, Z = np.meshgrid(x, x, x, indexing="ij")
    exact = np.stack([np.sin(k * Z) + np.cos(k * Y), np.sin(k * X) + np.cos(k * Z), np.sin(k * Y) + np.cos(k * X)])
    exact *= math.exp(-0.05 * k**2 * t)
    u = np.fft.irfftn(np.concatenate([u_hat, np.zeros((3, n, n, 1))], axis=-1), s=(n, n, n), axes=(1, 2, 3))
    error = np.linalg.norm(u - exact) / np.linalg.norm(exact)
    assert error <= 1e-13, error
    assert metrics["error"] <= 1e-13 and metrics["divergence"] <= 1e-13  # the solver's own diagnostics agree
    assert metrics["energy"] == pytest.approx(1.5 * math.exp(-2 * 0.05 * k**2 * t), rel=1e-13)  # <|u|^2>/2 = 3/2 V^2
    assert metrics["steps"] > 1  # CFL-chosen steps, not one jump


def test_taylor_green_stays_divergence_free_and_dissipates_what_it_loses(sim_config, mesh_of):
    """Taylor-Green at Re = 100 on 16^3 to t = 2: the divergence stays at round-off (<= 1e-13 relative to the
    velocity gradient), and the energy lost between frames is the dissipation rate integrated over them
    (trapezoid over 0.05 time units: agreement to 1e-4 relative)."""
    cfg = sim_config(*FLOW, "navier_stokes_3d.viscosity=0.01", "sim.t_end=2.0", "output.frames=40")
    sim = make_simulation(cfg, mesh_of("2x4"))
    state = sim.initial_state()
    rows = [jax.device_get(sim.measure(state))]
    for _ in range(cfg.output.frames):
        state, metrics = sim.frame_step(state, None)
        rows.append(jax.device_get(metrics))
    assert max(r["divergence"] for r in rows) <= 1e-13
    energy = np.array([r["energy"] for r in rows])
    rate = np.array([r["dissipation"] for r in rows])
    lost, integral = energy[:-1] - energy[1:], 0.5 * (rate[:-1] + rate[1:]) * 0.05
    np.testing.assert_allclose(lost, integral, rtol=1e-4)
    assert rate[-1] > 1.2 * rate[0]  # the vortex stretches: dissipation grows before it decays


def test_inviscid_flow_conserves_energy(sim_config, mesh_of):
    """nu = 0: the dealiased Galerkin system conserves energy exactly, so what changes is RK4's error: 1e-5
    relative at most at CFL 0.5 over t = 0..2 (measured 7e-7, vortex stretching under way), and more than 16x
    less at half the step (fourth order)."""
    changes = []
    for cfl in (0.5, 0.25):
        cfg = sim_config(*FLOW, "navier_stokes_3d.viscosity=0", "sim.t_end=2.0", "output.frames=1", f"sim.cfl={cfl}")
        _, metrics, _, _ = run(cfg, mesh_of("1 device"))
        changes.append(abs(metrics["energy"] / 0.125 - 1))
        assert metrics["dissipation"] == 0 and metrics["enstrophy"] > 0.5  # enstrophy grew from 0.375
    print("energy change at CFL 0.5, 0.25:", changes)
    assert changes[0] <= 1e-5 and changes[1] < changes[0] / 16


def test_energy_spectrum_sums_to_the_energy(sim_config, mesh_of):
    cfg = sim_config(*FLOW, "navier_stokes_3d.viscosity=0.01", "sim.t_end=1.0", "output.frames=1")
    _, metrics, sim, state = run(cfg, mesh_of("2x2"))
    spectrum = np.asarray(sim.spectrum(state))
    assert spectrum.shape == (ns3.shells(16),)
    assert spectrum.sum() == pytest.approx(metrics["energy"], rel=1e-13)
    assert spectrum[2] > 0.9 * spectrum.sum()  # most energy still at |k| = sqrt(3) ~ 2, where it started


# SHARDING -----------------------------------------------------------------------------------------------------


def test_one_device_and_pencil_meshes_agree(sim_config, mesh_of):
    """1 device vs 2x2, 2x4 and the 8x1 slab: float64 fields within 1e-13 relative (one device runs rfftn, the
    meshes 1-D transforms: round-off apart), the meshes bit-identical to each other. On 2x4 the compiled frame
    transposes with all-to-all and gathers nothing."""
    cfg = sim_config(*FLOW, "navier_stokes_3d.viscosity=0.01", "sim.t_end=0.5", "output.frames=2")
    reference, ref_metrics, _, _ = run(cfg, mesh_of("1 device"))
    fields = {}
    for layout in ("2x2", "2x4", "data=8"):
        sim = make_simulation(cfg, mesh_of(layout))
        state = sim.initial_state()
        step = sim.frame_step.lower(state, None).compile()
        hlo = step.as_text()
        assert "all-to-all" in hlo and "all-gather" not in hlo, layout
        for _ in range(cfg.output.frames):
            state, metrics = step(state, None)
        fields[layout] = np.asarray(state.params["u_hat"])
        assert metrics["steps"] == ref_metrics["steps"]
        assert np.max(np.abs(fields[layout] - reference)) <= 1e-13 * np.max(np.abs(reference)), layout
    np.testing.assert_array_equal(fields["2x2"], fields["2x4"])
    np.testing.assert_array_equal(fields["2x2"], fields["data=8"])


def test_a_second_frame_reuses_the_compiled_step(sim_config, mesh_of):
    cfg = sim_config(*FLOW, "sim.t_end=0.2", "output.frames=2")
    _, _, sim, _ = run(cfg, mesh_of("2x2"))
    assert sim.frame_step._cache_size() == 1


# GRADIENTS ----------------------------------------------------------------------------------------------------


def make_loss(mesh, *, steps=6, dt=0.05):
    """loss(u_hat0, viscosity) = the enstrophy after `steps` fixed IFRK4 steps, each a jax.checkpoint."""
    pencil = make_pencil(16, mesh)
    spec_of = lambda: ns3.make_spectrum(pencil, 2 * math.pi, jnp.float64)
    velocity_spec = jax.P(None, *pencil.spectral_spec)

    def body(u_hat0, viscosity):
        spec = spec_of()
        u_hat, _ = ns3.integrate_fixed(u_hat0, jnp.float64(0), jnp.float64(dt), steps, spec=spec, pencil=pencil,
                                       viscosity=viscosity, remat=True)
        return ns3.diagnostics(u_hat, spec, pencil, 0.0)["enstrophy"]

    def initial(amplitude):
        spec = spec_of()
        u = ns3.initial_velocity_hat("taylor_green", pencil, spec, length=2 * math.pi, mode=1, velocity=1.0,
                                     dtype=jnp.float64)
        # A second, divergence-free direction to differentiate along: a unit ABC flow at k = 2.
        du = ns3.initial_velocity_hat("abc", pencil, spec, length=2 * math.pi, mode=2, velocity=1.0, dtype=jnp.float64)
        return u + amplitude.astype(u.dtype) * du

    loss = jax.shard_map(body, mesh=mesh, in_specs=(velocity_spec, jax.P()), out_specs=jax.P())
    start = jax.shard_map(initial, mesh=mesh, in_specs=jax.P(), out_specs=velocity_spec)
    return jax.jit(lambda amplitude, viscosity: loss(start(amplitude), viscosity))


def test_gradients_through_a_run_match_central_differences(mesh_of):
    """d enstrophy / d viscosity and d / d(initial perturbation) through 6 checkpointed steps on a 2x2 mesh agree
    with central differences (h = 1e-6) to 1e-6 relative (measured ~1e-9), and with one device's to 1e-12."""
    grads = {}
    for layout in ("1 device", "2x2"):
        loss = make_loss(mesh_of(layout))
        grads[layout] = np.array(jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.float64(0.1), jnp.float64(0.02)))
    a, nu, h = 0.1, 0.02, 1e-6
    central = np.array([(float(loss(a + h, nu)) - float(loss(a - h, nu))) / (2 * h),
                        (float(loss(a, nu + h)) - float(loss(a, nu - h))) / (2 * h)])
    np.testing.assert_allclose(grads["2x2"], central, rtol=1e-6)
    np.testing.assert_allclose(grads["2x2"], grads["1 device"], rtol=1e-12)
    assert central[1] < 0  # more viscosity, less enstrophy
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=1))(jnp.float64(a), jnp.float64(nu)))
    assert "checkpoint" in jaxpr or "remat" in jaxpr
