"""Pseudo-spectral 2-D incompressible Navier-Stokes in vorticity form on a periodic square.

    w_t + u . grad(w) = nu lap(w) - alpha w + f,   u = (psi_y, -psi_x),   lap(psi) = -w

The state is the vorticity's Fourier transform `w_hat` in the slab's spectral layout (kx full, ky split; see
`slab.py`). The stiff linear part L = -nu k^2 - alpha is integrated exactly by an integrating factor, the nonlinear
term and forcing by classical RK4 (Lawson's IFRK4, `time_stepping.py`). The nonlinear term is evaluated in physical
space and dealiased by the 2/3 rule, so the scheme is the exact Galerkin truncation and conserves energy and
enstrophy when nu = alpha = 0, up to the RK4 error (why: docs/design-notes.md, this module's section).

Every function here works on one device's block and is meant to run inside `shard_map` (or directly when the
slab has one part); the only collectives are the slab's transposes and the reductions for the diagnostics
and the CFL step. Spectra are complex (complex64 or complex128), wavenumbers, decay factors and steps real of the
same precision, cast to the field's complex dtype explicitly where they multiply it: the code runs under strict
dtype promotion and computes bit for bit what standard promotion did.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from systolic.workloads.sim import time_stepping
from systolic.workloads.sim.slab import Slab

Forcing = Callable[[jax.Array], jax.Array]  # time -> forcing's w_hat (same layout as the state)


class Spectrum(NamedTuple):
    """Per-device wavenumber arrays, (n, 1) and (1, n/(2P)) or their broadcast (n, n/(2P))."""

    kx: jax.Array  # physical wavenumbers 2 pi m / length
    ky: jax.Array
    k2: jax.Array  # |k|^2
    inv_k2: jax.Array  # 1/|k|^2, 0 at k = 0 (the mean vorticity is zero on a periodic domain)
    dealias: jax.Array  # 1 where |kx|, |ky| < n/3 (square 2/3 rule), else 0
    parseval: jax.Array  # weights of the half spectrum: 1 for ky = 0, 2 for ky > 0 (the conjugate half)
    kx_index: jax.Array  # integer wavenumbers
    ky_index: jax.Array


def make_spectrum(slab: Slab, length: float, dtype: jnp.dtype) -> Spectrum:
    kx_i, ky_i = slab.wavenumber_indices()  # (n, 1), (1, n/(2P))
    scale = 2 * math.pi / length
    kx, ky = kx_i.astype(dtype) * scale, ky_i.astype(dtype) * scale  # integer indices to physical wavenumbers
    k2 = kx**2 + ky**2
    inv_k2 = jnp.where(k2 > 0, 1 / jnp.where(k2 > 0, k2, 1), 0)
    dealias = ((3 * jnp.abs(kx_i) < slab.n) & (3 * ky_i < slab.n)).astype(dtype)
    parseval = jnp.where(ky_i == 0, 1, 2).astype(dtype) * jnp.ones_like(kx)
    return Spectrum(kx, ky, k2, inv_k2, dealias, parseval, kx_i, ky_i)


def complex_dtype(spec: Spectrum) -> jnp.dtype:
    return jnp.dtype(jnp.complex128 if spec.k2.dtype == jnp.float64 else jnp.complex64)


def linear_rate(spec: Spectrum, viscosity: jax.Array | float, drag: jax.Array | float) -> jax.Array:
    """L in w_hat_t = L w_hat + N: viscous decay -nu k^2 and linear drag -alpha, (n, n/(2P)) real."""
    return -viscosity * spec.k2 - drag


def velocity_hat(w_hat: jax.Array, spec: Spectrum) -> tuple[jax.Array, jax.Array]:
    c = w_hat.dtype
    psi_hat = w_hat * spec.inv_k2.astype(c)  # lap psi = -w  ->  psi_hat = w_hat / k^2
    return 1j * spec.ky.astype(c) * psi_hat, -1j * spec.kx.astype(c) * psi_hat  # u = psi_y, v = -psi_x


def nonlinear(w_hat: jax.Array, spec: Spectrum, slab: Slab) -> tuple[jax.Array, jax.Array]:
    """-(u . grad w)^, dealiased, and this block's max(|u| + |v|) (for the CFL step)."""
    c = w_hat.dtype
    u_hat, v_hat = velocity_hat(w_hat, spec)
    # One batched inverse transform (one all_to_all) for all four fields instead of four.
    fields = jnp.stack([u_hat, v_hat, 1j * spec.kx.astype(c) * w_hat, 1j * spec.ky.astype(c) * w_hat])  # (4, n, n/(2P))
    u, v, wx, wy = slab.inverse(fields)  # each (n/P, n) real
    advection = u * wx + v * wy
    speed = jnp.max(jnp.abs(u) + jnp.abs(v))
    return -slab.forward(advection) * spec.dealias.astype(c), speed


def make_rhs(spec: Spectrum, slab: Slab, forcing: Forcing | None) -> Callable[[jax.Array, jax.Array], jax.Array]:
    def rhs(w_hat: jax.Array, t: jax.Array) -> jax.Array:
        n_hat, _ = nonlinear(w_hat, spec, slab)
        return n_hat if forcing is None else n_hat + forcing(t) * spec.dealias.astype(n_hat.dtype)

    return rhs


def integrate_fixed(w_hat: jax.Array, t: jax.Array, dt: jax.Array, steps: int, *, spec: Spectrum, slab: Slab,
                    viscosity: jax.Array | float, drag: jax.Array | float = 0.0,
                    forcing: Forcing | None = None, remat: bool = False) -> tuple[jax.Array, jax.Array]:
    """`steps` IFRK4 steps of size dt as one `lax.scan`; reverse-mode differentiable (time_stepping.py)."""
    decay_half = time_stepping.exp(linear_rate(spec, viscosity, drag) * (0.5 * dt))
    return time_stepping.integrate_fixed(w_hat, t, dt, steps, rhs=make_rhs(spec, slab, forcing), decay_half=decay_half,
                                         remat=remat)


def integrate_cfl(w_hat: jax.Array, t: jax.Array, t_stop: jax.Array, *, cfl: float, dx: float, dt_max: float,
                  spec: Spectrum, slab: Slab, viscosity: float, drag: float = 0.0,
                  forcing: Forcing | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adaptive steps dt = cfl dx / max(|u| + |v|) (capped at dt_max), the last one shortened to land exactly
    on t_stop. Returns (w_hat, t_stop, number of steps). Not reverse-differentiable (a while loop)."""

    def first_stage(w, time):
        n_hat, speed = nonlinear(w, spec, slab)
        return n_hat + (forcing(time) * spec.dealias.astype(w.dtype) if forcing is not None else 0), speed

    return time_stepping.integrate_cfl(w_hat, t, t_stop, rhs=make_rhs(spec, slab, forcing), first_stage=first_stage,
                                       rate=linear_rate(spec, viscosity, drag), pmax=slab.pmax, cfl=cfl, dx=dx,
                                       dt_max=dt_max)


# DIAGNOSTICS --------------------------------------------------------------------------------------------------


def energy_enstrophy(w_hat: jax.Array, spec: Spectrum, slab: Slab) -> tuple[jax.Array, jax.Array]:
    """Mean kinetic energy 1/2 <|u|^2> and enstrophy 1/2 <w^2> by Parseval over the half spectrum."""
    power = spec.parseval * jnp.abs(w_hat) ** 2 / float(slab.n) ** 4  # mean of w^2 = sum |w_hat|^2 / n^4
    energy = 0.5 * slab.psum(jnp.sum(power * spec.inv_k2))  # |u_hat|^2 + |v_hat|^2 = |w_hat|^2 / k^2
    enstrophy = 0.5 * slab.psum(jnp.sum(power))
    return energy, enstrophy


def relative_l2(a_hat: jax.Array, b_hat: jax.Array, spec: Spectrum, slab: Slab) -> jax.Array:
    """||a - b|| / ||b|| of the physical fields, computed in spectral space (Parseval)."""
    diff = slab.psum(jnp.sum(spec.parseval * jnp.abs(a_hat - b_hat) ** 2))
    norm = slab.psum(jnp.sum(spec.parseval * jnp.abs(b_hat) ** 2))
    return jnp.sqrt(diff / norm)


# INITIAL CONDITIONS AND FORCING -------------------------------------------------------------------------------


def taylor_green_hat(spec: Spectrum, n: int, length: float, mode: int, amplitude: float) -> jax.Array:
    """w = -2 U k cos(k x) cos(k y), k = 2 pi mode / length, built directly in spectral space: on the grid,
    cos(k x) cos(k y) transforms to n^2 / 4 at (kx, ky) = (+-mode, mode) in the kept half spectrum."""
    k = 2 * math.pi * mode / length
    on_mode = (jnp.abs(spec.kx_index) == mode) & (spec.ky_index == mode)
    return jnp.where(on_mode, -2 * amplitude * k * n * n / 4, 0).astype(complex_dtype(spec))


def kolmogorov_hat(spec: Spectrum, n: int, mode: int, amplitude: float) -> jax.Array:
    """f = amplitude cos(k_f y): transform amplitude n^2 / 2 at (kx, ky) = (0, mode)."""
    on_mode = (spec.kx_index == 0) & (spec.ky_index == mode)
    return jnp.where(on_mode, amplitude * n * n / 2, 0).astype(complex_dtype(spec))


def random_vorticity_hat(noise_hat: jax.Array, spec: Spectrum, slab: Slab, peak_mode: int,
                         energy: float) -> jax.Array:
    """White noise shaped to the energy spectrum E(k) ~ k^4 exp(-2 (k/k0)^2), which peaks at k0 = peak_mode,
    then scaled so the mean kinetic energy is `energy`. A shell of radius k holds ~k modes each carrying
    |w_hat|^2 / k^2 of energy, so E(k) ~ S(k)^2 / k for white noise times S(k): S = k^2.5 exp(-(k/k0)^2)."""
    c = noise_hat.dtype
    k = jnp.sqrt(spec.kx_index.astype(spec.k2.dtype) ** 2 + spec.ky_index.astype(spec.k2.dtype) ** 2)
    shaped = noise_hat * ((k / peak_mode) ** 2.5).astype(c) * time_stepping.exp(-((k / peak_mode) ** 2)).astype(c)
    shaped = jnp.where(k > 0, shaped * spec.dealias.astype(c), 0)
    e, _ = energy_enstrophy(shaped, spec, slab)
    return shaped * jnp.sqrt(energy / e).astype(c)
