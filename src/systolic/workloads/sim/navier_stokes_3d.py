"""Pseudo-spectral 3-D incompressible Navier-Stokes in velocity form on a periodic cube.

    u_t = P(u x w) + nu lap(u),   w = curl(u),   div(u) = 0

The state is the velocity's Fourier transform `u_hat`, (3, n, n/P1, n/(2 P2)) in the pencil's spectral layout
(`pencil.py`). The nonlinear term is taken in rotational form, so its gradient part and the pressure both vanish
under the projection P = I - k k^T / |k|^2 onto divergence-free fields: no pressure solve. u x w is formed in
physical space and dealiased by the 2/3 rule; the viscous term is integrated exactly by its integrating factor, the
rest by RK4 (Lawson's IFRK4, `time_stepping.py`), as the 2-D solver does. The derivation and the transforms per
stage: docs/design-notes.md, this module's section.

Every function here works on one device's block and runs inside `shard_map` (or directly on one device); the
only collectives are the pencil transposes and the reductions for diagnostics and the CFL step.

Dtypes: spectra complex64/complex128, wavenumbers and factors real of the same precision, cast to the field's
complex dtype explicitly where they multiply it (the code runs under strict dtype promotion).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from systolic.workloads.sim import time_stepping
from systolic.workloads.sim.pencil import Pencil


class Spectrum(NamedTuple):
    """Per-device wavenumber arrays: kx (n, 1, 1), ky (1, n/P1, 1), kz (1, 1, n/(2 P2)), or their broadcast."""

    kx: jax.Array  # physical wavenumbers 2 pi m / length
    ky: jax.Array
    kz: jax.Array
    k2: jax.Array  # |k|^2, (n, n/P1, n/(2 P2))
    inv_k2: jax.Array  # 1/|k|^2, 0 at k = 0
    dealias: jax.Array  # 1 where |kx|, |ky|, |kz| < n/3 (cube 2/3 rule), else 0
    parseval: jax.Array  # weights of the half spectrum: 1 for kz = 0, 2 for kz > 0 (the conjugate half)
    shell: jax.Array  # int32 round(|k| in units of 2 pi / length): the energy spectrum's bin


def make_spectrum(pencil: Pencil, length: float, dtype: jnp.dtype) -> Spectrum:
    kx_i, ky_i, kz_i = pencil.wavenumber_indices()
    scale = 2 * math.pi / length
    kx, ky, kz = (k.astype(dtype) * scale for k in (kx_i, ky_i, kz_i))  # integer indices to physical wavenumbers
    k2 = kx**2 + ky**2 + kz**2
    inv_k2 = jnp.where(k2 > 0, 1 / jnp.where(k2 > 0, k2, 1), 0)
    n = pencil.n
    dealias = ((3 * jnp.abs(kx_i) < n) & (3 * jnp.abs(ky_i) < n) & (3 * kz_i < n)).astype(dtype)
    parseval = jnp.broadcast_to(jnp.where(kz_i == 0, 1, 2).astype(dtype), k2.shape)
    index2 = (kx_i**2 + ky_i**2 + kz_i**2).astype(dtype)
    shell = jnp.round(jnp.sqrt(index2)).astype(jnp.int32)
    return Spectrum(kx, ky, kz, k2, inv_k2, dealias, parseval, shell)


def shells(n: int) -> int:
    """Bins of the energy spectrum: integer |k| from 0 to the largest kept by dealiasing, sqrt(3) (n/3)."""
    return int(math.sqrt(3) * n / 3) + 2


# THE EQUATION -------------------------------------------------------------------------------------------------


def curl(u_hat: jax.Array, spec: Spectrum) -> jax.Array:
    """w_hat = i k x u_hat, (3, ...) -> (3, ...)."""
    c = u_hat.dtype
    ikx, iky, ikz = (1j * k.astype(c) for k in (spec.kx, spec.ky, spec.kz))
    ux, uy, uz = u_hat
    return jnp.stack([iky * uz - ikz * uy, ikz * ux - ikx * uz, ikx * uy - iky * ux])


def project(h_hat: jax.Array, spec: Spectrum) -> jax.Array:
    """P h = h - k (k . h) / |k|^2: the divergence-free part (the pressure's job, done exactly in Fourier space)."""
    c = h_hat.dtype
    kx, ky, kz = (k.astype(c) for k in (spec.kx, spec.ky, spec.kz))
    k_dot_h_over_k2 = (kx * h_hat[0] + ky * h_hat[1] + kz * h_hat[2]) * spec.inv_k2.astype(c)
    return h_hat - jnp.stack([kx * k_dot_h_over_k2, ky * k_dot_h_over_k2, kz * k_dot_h_over_k2])


def nonlinear(u_hat: jax.Array, spec: Spectrum, pencil: Pencil) -> tuple[jax.Array, jax.Array]:
    """P(u x w)^, dealiased, and this block's max(|u| + |v| + |w|) (for the CFL step)."""
    # One batched inverse transform (one pair of all_to_alls) for all six fields instead of six.
    fields = jnp.concatenate([u_hat, curl(u_hat, spec)])  # (6, n, n/P1, n/(2 P2))
    physical = pencil.inverse(fields)  # (6, n/P1, n/P2, n) real
    (ux, uy, uz), (wx, wy, wz) = physical[:3], physical[3:]
    cross = jnp.stack([uy * wz - uz * wy, uz * wx - ux * wz, ux * wy - uy * wx])  # (3, n/P1, n/P2, n)
    speed = jnp.max(jnp.abs(ux) + jnp.abs(uy) + jnp.abs(uz))
    h_hat = pencil.forward(cross) * spec.dealias.astype(u_hat.dtype)
    return project(h_hat, spec), speed


def make_rhs(spec: Spectrum, pencil: Pencil) -> time_stepping.Rhs:
    return lambda u_hat, t: nonlinear(u_hat, spec, pencil)[0]


def integrate_fixed(u_hat: jax.Array, t: jax.Array, dt: jax.Array, steps: int, *, spec: Spectrum, pencil: Pencil,
                    viscosity: jax.Array | float, remat: bool = False) -> tuple[jax.Array, jax.Array]:
    """`steps` IFRK4 steps of size dt as one `lax.scan`; reverse-mode differentiable (each step a
    `jax.checkpoint` with `remat`)."""
    decay_half = time_stepping.exp(-viscosity * spec.k2 * (0.5 * dt))
    return time_stepping.integrate_fixed(u_hat, t, dt, steps, rhs=make_rhs(spec, pencil), decay_half=decay_half,
                                         remat=remat)


def integrate_cfl(u_hat: jax.Array, t: jax.Array, t_stop: jax.Array, *, cfl: float, dx: float, dt_max: float,
                  spec: Spectrum, pencil: Pencil, viscosity: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adaptive steps dt = cfl dx / max(|u| + |v| + |w|) (capped at dt_max) up to t_stop exactly. Returns
    (u_hat, t_stop, number of steps). Not reverse-differentiable (a while loop)."""
    return time_stepping.integrate_cfl(u_hat, t, t_stop, rhs=make_rhs(spec, pencil),
                                       first_stage=lambda u, _: nonlinear(u, spec, pencil), rate=-viscosity * spec.k2,
                                       pmax=pencil.pmax, cfl=cfl, dx=dx, dt_max=dt_max)


# DIAGNOSTICS --------------------------------------------------------------------------------------------------


def _total(x: jax.Array, pencil: Pencil) -> jax.Array:
    """Sum over the whole grid, one axis at a time: in float32 a single pass over 10^6+ values loses digits that
    the dissipation peak's comparison needs; three passes of <= n values each keep the error near n eps."""
    return pencil.psum(jnp.sum(jnp.sum(jnp.sum(x, axis=-1), axis=-1), axis=-1))


def diagnostics(u_hat: jax.Array, spec: Spectrum, pencil: Pencil, viscosity: float) -> dict[str, jax.Array]:
    """Mean kinetic energy 1/2 <|u|^2>, enstrophy 1/2 <|w|^2>, dissipation rate 2 nu enstrophy (= -dE/dt for the
    truncated system) and the divergence relative to the velocity gradient, all by Parseval."""
    power = spec.parseval * jnp.sum(jnp.abs(u_hat) ** 2, axis=0) / float(pencil.n) ** 6  # (n, n/P1, n/(2 P2))
    energy = 0.5 * _total(power, pencil)
    enstrophy = 0.5 * _total(power * spec.k2, pencil)  # |k x u|^2 = |k|^2 |u|^2 for a divergence-free field
    c = u_hat.dtype
    k_dot_u = spec.kx.astype(c) * u_hat[0] + spec.ky.astype(c) * u_hat[1] + spec.kz.astype(c) * u_hat[2]
    divergence = jnp.sqrt(_total(spec.parseval * jnp.abs(k_dot_u) ** 2, pencil)
                          / _total(spec.parseval * spec.k2 * jnp.sum(jnp.abs(u_hat) ** 2, axis=0), pencil))
    return {"energy": energy, "enstrophy": enstrophy, "dissipation": 2 * viscosity * enstrophy,
            "divergence": divergence}


def energy_spectrum(u_hat: jax.Array, spec: Spectrum, pencil: Pencil) -> jax.Array:
    """E(k): the energy in each shell of integer |k| (in units of 2 pi / length), (shells(n),); sums to the
    energy."""
    power = 0.5 * spec.parseval * jnp.sum(jnp.abs(u_hat) ** 2, axis=0) / float(pencil.n) ** 6
    local = jnp.zeros(shells(pencil.n), power.dtype).at[spec.shell.ravel()].add(power.ravel(), mode="drop")
    return pencil.psum(local)


def relative_l2(a_hat: jax.Array, b_hat: jax.Array, spec: Spectrum, pencil: Pencil) -> jax.Array:
    """||a - b|| / ||b|| of the physical velocity fields, computed in spectral space (Parseval)."""
    diff = _total(spec.parseval * jnp.sum(jnp.abs(a_hat - b_hat) ** 2, axis=0), pencil)
    return jnp.sqrt(diff / _total(spec.parseval * jnp.sum(jnp.abs(b_hat) ** 2, axis=0), pencil))


def vorticity_magnitude(u_hat: jax.Array, spec: Spectrum, pencil: Pencil) -> jax.Array:
    """|w| in physical space, (n/P1, n/P2, n)."""
    w = pencil.inverse(curl(u_hat, spec))  # (3, n/P1, n/P2, n)
    return jnp.sqrt(jnp.sum(w**2, axis=0))


# INITIAL CONDITIONS -------------------------------------------------------------------------------------------


def taylor_green(x: jax.Array, y: jax.Array, z: jax.Array, velocity: float) -> jax.Array:
    """The Taylor-Green vortex (Brachet et al. 1983): u = V sin x cos y cos z, v = -V cos x sin y cos z, w = 0,
    at scaled coordinates (k x, k y, k z). Divergence-free; not a steady solution: it rolls up into turbulence."""
    u = velocity * jnp.sin(x) * jnp.cos(y) * jnp.cos(z)
    v = -velocity * jnp.cos(x) * jnp.sin(y) * jnp.cos(z)
    return jnp.stack([u, v, jnp.zeros_like(u)])


def abc_flow(x: jax.Array, y: jax.Array, z: jax.Array, velocity: float) -> jax.Array:
    """The Arnold-Beltrami-Childress flow with A = B = C = V: u = (V sin z + V cos y, V sin x + V cos z,
    V sin y + V cos x). Its vorticity is k u (a Beltrami field), so u x w = 0 and it decays as exp(-nu k^2 t)
    without changing shape: an exact solution of the full nonlinear equations."""
    return velocity * jnp.stack([jnp.sin(z) + jnp.cos(y), jnp.sin(x) + jnp.cos(z), jnp.sin(y) + jnp.cos(x)])


INITIAL: dict[str, Callable[..., jax.Array]] = {"taylor_green": taylor_green, "abc": abc_flow}


def initial_velocity_hat(kind: str, pencil: Pencil, spec: Spectrum, *, length: float, mode: int,
                         velocity: float, dtype: jnp.dtype) -> jax.Array:
    """The named initial field sampled on this device's pencil, transformed and dealiased: (3, n, n/P1, n/(2P2))."""
    scale = 2 * math.pi * mode / length  # grid index -> k x
    dx = length / pencil.n
    x, y, z = jnp.broadcast_arrays(*(i.astype(dtype) * (dx * scale) for i in pencil.physical_indices()))
    u_hat = pencil.forward(INITIAL[kind](x, y, z, velocity))  # from (3, n/P1, n/P2, n)
    return u_hat * spec.dealias.astype(u_hat.dtype)
