"""The spectral Navier-Stokes solver against exact solutions: Taylor-Green, a manufactured solution with a live
nonlinear term (fourth order in time, exponential convergence in space), and inviscid conservation."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.workloads.sim import navier_stokes as ns
from systolic.workloads.sim.slab import Slab
from systolic.workloads.sim.solver import make_simulation

pytestmark = pytest.mark.usefixtures("x64")


def grid(n):
    x = np.arange(n) * 2 * np.pi / n
    return np.meshgrid(x, x, indexing="ij")  # rows are x, columns y


# TAYLOR-GREEN -------------------------------------------------------------------------------------------------


def test_taylor_green_matches_exact_decay(sim_config, mesh_of):
    """w = -2 U k cos(kx) cos(ky) exp(-2 nu k^2 t): relative error <= 1e-10 in float64 after 1 time unit of
    CFL-chosen steps. (Measured ~1e-15: the integrating factor is exact and the nonlinear term cancels.)"""
    cfg = sim_config("grid.n=32", "sim.t_end=1.0", "output.frames=2", "sim.dtype=float64",
                     "navier_stokes.initial=taylor_green", "navier_stokes.initial_wavenumber=2",
                     "navier_stokes.initial_energy=0.25", "navier_stokes.viscosity=0.05")
    sim = make_simulation(cfg, mesh_of("1 device"))
    state = sim.initial_state()
    for _ in range(cfg.output.frames):
        state, metrics = sim.frame_step(state, None)
    w = np.asarray(sim.picture(state))
    x, y = grid(32)
    k, u0, t = 2.0, 1.0, 1.0
    exact = -2 * u0 * k * np.cos(k * x) * np.cos(k * y) * np.exp(-2 * 0.05 * k**2 * t)
    error = np.linalg.norm(w - exact) / np.linalg.norm(exact)
    assert error <= 1e-10, error
    assert float(metrics["error"]) <= 1e-10  # the solver's own diagnostic agrees
    assert int(metrics["steps"]) > 1  # CFL-chosen steps, not one jump to the end


# MANUFACTURED SOLUTION ----------------------------------------------------------------------------------------
# psi(x, y, t) = cos(t) phi(x, y) + sin(t) chi(x, y), so w = -lap psi is known exactly, and the forcing
# f = w_t + u . grad w - nu lap w makes it a solution. phi and chi mix Laplacian eigenvalues, so the nonlinear
# term u . grad w is not zero. Their derivatives come from FFTs on a fine grid (72^2), where the functions below
# are resolved to round-off, and are then sampled on the coarse grids the solver runs on.

FINE = 72


def _fine_fields(fn):
    """fn, -lap fn = w, lap w and the first derivatives of fn and w on the FINE grid, by exact FFT derivatives."""
    x, y = grid(FINE)
    f_hat = np.fft.fft2(fn(x, y))
    kx = np.fft.fftfreq(FINE, 1 / FINE)[:, None]
    ky = np.fft.fftfreq(FINE, 1 / FINE)[None, :]
    k2 = kx**2 + ky**2
    real = lambda g_hat: np.real(np.fft.ifft2(g_hat))
    w_hat = k2 * f_hat
    return {"w": real(w_hat), "lap_w": real(-k2 * w_hat), "fx": real(1j * kx * f_hat), "fy": real(1j * ky * f_hat),
            "wx": real(1j * kx * w_hat), "wy": real(1j * ky * w_hat)}


def manufactured(phi, chi, n):
    """(the 7 forcing fields in the solver's spectral layout, exact w(t) on the n-grid, w_hat(0))."""
    stride = FINE // n
    g = {f"{name}_{k}": v[::stride, ::stride] for name, fn in (("p", phi), ("c", chi))
         for k, v in _fine_fields(fn).items()}
    jac = lambda a, b: g[f"{a}_fy"] * g[f"{b}_wx"] - g[f"{a}_fx"] * g[f"{b}_wy"]  # (u of psi_a) . grad w_b
    slab = Slab(n)
    fields = np.stack([g["p_w"], g["c_w"], g["p_lap_w"], g["c_lap_w"], jac("p", "p"), jac("c", "c"),
                       jac("p", "c") + jac("c", "p")])
    exact = lambda t: np.cos(t) * g["p_w"] + np.sin(t) * g["c_w"]
    return slab.forward(jnp.asarray(fields)), exact, slab.forward(jnp.asarray(exact(0.0)))


@functools.cache
def advance_8_steps(n, viscosity):
    """A jitted chunk of 8 IFRK4 steps; dt and the forcing fields are arguments, so one compilation per grid."""
    slab = Slab(n)
    spec = ns.make_spectrum(slab, 2 * math.pi, jnp.float64)

    @jax.jit
    def advance(w, t, dt, fields_hat):  # fields_hat (7, n, n/2)
        def forcing(time):
            s, co = jnp.sin(time), jnp.cos(time)
            coeffs = jnp.stack([-s, co, -viscosity * co, -viscosity * s, co * co, s * s, s * co])  # w_t, -nu lap w, J
            return jnp.tensordot(coeffs.astype(fields_hat.dtype), fields_hat, axes=1)

        return ns.integrate_fixed(w, t, dt, 8, spec=spec, slab=slab, viscosity=viscosity, forcing=forcing)

    return advance, spec.dealias, slab


def solve(phi, chi, n, steps, t_end, viscosity=0.05):
    """Max-norm relative error at t_end after `steps` IFRK4 steps."""
    fields_hat, exact, w0 = manufactured(phi, chi, n)
    advance, dealias, slab = advance_8_steps(n, viscosity)
    w, t = w0 * dealias.astype(w0.dtype), jnp.float64(0)
    for _ in range(steps // 8):
        w, t = advance(w, t, jnp.float64(t_end / steps), fields_hat)
    ref = exact(t_end)
    return np.max(np.abs(np.asarray(slab.inverse(w)) - ref)) / np.max(np.abs(ref))


def band_limited_phi(x, y):
    return np.sin(x) * np.cos(2 * y) + 0.5 * np.cos(3 * x + 1.0) * np.sin(y)


def band_limited_chi(x, y):
    return np.cos(2 * x + 0.3) * np.sin(y) + 0.3 * np.sin(x + 2 * y)


def test_manufactured_solution_is_fourth_order_in_time():
    """Band-limited phi, chi (|k| <= 3, so products have |k| <= 6 < 24/3): no spatial error at n = 24, and the
    error, the time stepper's alone, falls 16x per halving of dt."""
    errors = [solve(band_limited_phi, band_limited_chi, 24, steps, t_end=1.0) for steps in (8, 16, 32)]
    orders = [math.log2(a / b) for a, b in zip(errors, errors[1:])]
    assert errors[-1] > 1e-11, errors  # well above round-off, so the rates mean something
    assert all(3.8 < p < 4.3 for p in orders), (errors, orders)


def smooth_phi(x, y):
    return np.sin(y) / (2 - np.cos(x))  # analytic, Fourier coefficients ~ 0.27^|k|: not band-limited


def smooth_chi(x, y):
    return np.cos(x) / (2 + np.sin(y + 0.5))


def test_manufactured_solution_converges_spectrally_in_space():
    """Analytic, non-band-limited fields: the error falls geometrically with n (measured 0.10, 1.8e-3, 2.0e-5
    at n = 12, 24, 36), faster than any power of n: the apparent algebraic order keeps rising (5.9, then 11).
    64 steps to t = 0.5 keep the time error (~1e-11) out of the way."""
    sizes = (12, 24, 36)
    errors = [solve(smooth_phi, smooth_chi, n, steps=64, t_end=0.5) for n in sizes]
    orders = [math.log(a / b) / math.log(m / n) for a, b, n, m in zip(errors, errors[1:], sizes, sizes[1:])]
    assert errors[-1] < 1e-4, errors
    assert orders == sorted(orders) and orders[-1] > 8, (errors, orders)


# CONSERVATION, DIAGNOSTICS, FORCING ---------------------------------------------------------------------------


def test_inviscid_run_conserves_energy_and_enstrophy():
    """nu = 0, n = 64, a random field with energy 0.5 peaked at k = 4, t = 0..5 (about 5 eddy turnover times).
    The 2/3-rule Galerkin truncation conserves energy and enstrophy exactly, so what changes them is RK4's
    damping of the fastest resolved modes. Stated tolerance at CFL 0.5: energy 1e-4, enstrophy 1e-3 relative
    (measured 1.2e-5 and 2.5e-4); halving the step cuts the drift ~32x (RK4's dt^5 energy error), which shows
    it is time-stepping error and not a leak in the spatial scheme."""
    n = 64
    slab = Slab(n)
    spec = ns.make_spectrum(slab, 2 * math.pi, jnp.float64)
    noise = slab.forward(jnp.asarray(np.random.default_rng(0).normal(size=(n, n))))
    w0 = ns.random_vorticity_hat(noise, spec, slab, peak_mode=4, energy=0.5)

    @jax.jit
    def drift(cfl):
        w, _, steps = ns.integrate_cfl(w0, jnp.float64(0), jnp.float64(5.0), cfl=cfl, dx=2 * math.pi / n, dt_max=1.0,
                                       spec=spec, slab=slab, viscosity=0.0)
        (e0, z0), (e1, z1) = ns.energy_enstrophy(w0, spec, slab), ns.energy_enstrophy(w, spec, slab)
        return jnp.abs(e1 / e0 - 1), jnp.abs(z1 / z0 - 1), steps

    energy, enstrophy, steps = drift(0.5)
    assert steps > 300 and energy < 1e-4 and enstrophy < 1e-3, (energy, enstrophy, steps)
    energy_half, enstrophy_half, _ = drift(0.25)
    assert energy / energy_half > 16 and enstrophy / enstrophy_half > 16, (energy_half, enstrophy_half)


def test_energy_and_enstrophy_by_parseval_match_physical_space():
    n = 32
    slab = Slab(n)
    spec = ns.make_spectrum(slab, 2 * math.pi, jnp.float64)
    noise = jnp.asarray(np.random.default_rng(1).normal(size=(n, n)))
    w_hat = jax.jit(lambda z: ns.random_vorticity_hat(slab.forward(z), spec, slab, peak_mode=3, energy=0.7))(noise)
    energy, enstrophy = jax.jit(ns.energy_enstrophy, static_argnums=2)(w_hat, spec, slab)
    u, v, w = np.asarray(jax.jit(slab.inverse)(jnp.stack([*ns.velocity_hat(w_hat, spec), w_hat])))
    assert float(energy) == pytest.approx(0.7, rel=1e-12)
    assert float(energy) == pytest.approx(0.5 * np.mean(u**2 + v**2), rel=1e-12)
    assert float(enstrophy) == pytest.approx(0.5 * np.mean(w**2), rel=1e-12)


def test_kolmogorov_and_taylor_green_modes_match_their_physical_fields():
    n, length = 16, 3.0
    slab = Slab(n)
    x = np.arange(n) * length / n
    x, y = np.meshgrid(x, x, indexing="ij")
    k = 2 * np.pi / length
    f = 0.7 * np.cos(3 * k * y)
    w = -2 * 1.5 * 2 * k * np.cos(2 * k * x) * np.cos(2 * k * y)

    @jax.jit
    def spectral_and_transformed(f, w):
        spec = ns.make_spectrum(slab, length, jnp.float64)
        built = (ns.kolmogorov_hat(spec, n, 3, 0.7), ns.taylor_green_hat(spec, n, length, 2, 1.5))
        return built, (slab.forward(f), slab.forward(w))

    built, transformed = spectral_and_transformed(jnp.asarray(f), jnp.asarray(w))
    np.testing.assert_allclose(built[0], transformed[0], atol=1e-12)
    np.testing.assert_allclose(built[1], transformed[1], atol=1e-11)
