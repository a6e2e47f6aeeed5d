"""Time integration shared by the spectral solvers (2-D vorticity, 3-D velocity): Lawson's integrating-factor RK4
with fixed steps (a differentiable `lax.scan`) or CFL-chosen steps (a `lax.while_loop`).

The equation is u_t = L u + N(u, t) with a diagonal linear part L (viscosity, drag) that the integrating factor
exp(L dt) solves exactly, so the step size is limited by the nonlinear term only. The solvers hand in N (`rhs`)
and exp(L dt / 2) (`decay_half`, made with `exp` below); u is any complex array that the real decay factor
broadcasts against.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

Rhs = Callable[[jax.Array, jax.Array], jax.Array]  # (u, t) -> N(u, t)

# Cephes' expf: exp(x) = 2^n exp(r), n = round(x log2 e), r = x - n ln 2 with ln 2 in two parts (C1 exact in float32),
# exp(r) = 1 + r + r^2 P(r) on |r| <= ln(2) / 2.
_LOG2E, _LN2_HI, _LN2_LO = 1.44269504088896341, 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_EXP_MIN, _EXP_MAX = -87.33654, 88.72283  # exp(x) below the first is under float32's smallest normal number


@jax.custom_jvp
def exp(x: jax.Array) -> jax.Array:
    """exp(x), unbiased in float32 on every platform: the integrating factors' exponential.

    The TPU's own float32 `jnp.exp` is biased low: on a v5e, for x in [-1e-3, 0] (a viscous factor's range) by 26 ulps
    on average, 59 at most (2026-12-07; docs/benchmarks.md, sim on the TPU v5e). Every step multiplies the spectrum by
    such a factor, so the bias drains energy steadily: the 64^2 turbulence run of tests/tpu/ lost 1.4e-4 of its energy
    against the CPU's in 50 steps, 0.6% more dissipation than the viscosity's. This polynomial uses only multiplies
    and adds, which round to nearest on every platform: within 0.97 ulp of float64 NumPy on this CPU, mean error
    -0.009 ulp (tests/workloads/sim/test_time_stepping.py); on the v5e +0.000, max 0.80
    (tests/tpu/test_workload_parity.py). float64 (and narrower) inputs take `jnp.exp`.
    """
    if x.dtype != jnp.float32:
        return jnp.exp(x)
    n = jnp.floor(jnp.clip(x, _EXP_MIN, _EXP_MAX) * _LOG2E + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln(2) / 2; exact in its first part (n * C1 has <= 17 bits)
    poly = jnp.full_like(r, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        poly = poly * r + c
    y = jnp.ldexp(poly * (r * r) + r + 1, n.astype(jnp.int32))
    return jnp.where(x < _EXP_MIN, 0.0, jnp.where(x > _EXP_MAX, jnp.inf, y)).astype(x.dtype)


@exp.defjvp
def _exp_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    y = exp(x)
    return y, y * dx


def ifrk4_step(w_hat: jax.Array, t: jax.Array, dt: jax.Array, rhs: Rhs, decay_half: jax.Array,
               first_stage: jax.Array | None = None) -> jax.Array:
    """One Lawson RK4 step of w_t = L w + N(w, t), with decay_half = exp(L dt / 2) (exact for the linear part).

    `rhs(w_hat, t)` returns N; `first_stage` is N(w_hat, t) when the caller already has it. decay_half and dt
    are real: each real coefficient is formed in real arithmetic, then cast to the field's complex dtype.
    """

    def as_complex(real: jax.Array) -> jax.Array:
        return real.astype(w_hat.dtype)

    # Each coefficient (e * e three times) is its own expression, as before the casts were explicit: sharing one
    # would change the order in which the backward pass sums their cotangents, and so the gradient's last bit.
    e = decay_half
    a = rhs(w_hat, t) if first_stage is None else first_stage
    b = rhs(as_complex(e) * (w_hat + as_complex(0.5 * dt) * a), t + 0.5 * dt)
    c = rhs(as_complex(e) * w_hat + as_complex(0.5 * dt) * b, t + 0.5 * dt)
    d = rhs(as_complex(e * e) * w_hat + as_complex(dt * e) * c, t + dt)
    return as_complex(e * e) * w_hat + as_complex(dt / 6) * (as_complex(e * e) * a + as_complex(2 * e) * (b + c) + d)


def integrate_fixed(w_hat: jax.Array, t: jax.Array, dt: jax.Array, steps: int, *, rhs: Rhs, decay_half: jax.Array,
                    remat: bool = False) -> tuple[jax.Array, jax.Array]:
    """`steps` IFRK4 steps of size dt as one `lax.scan`; reverse-mode differentiable.

    With `remat`, each step is a `jax.checkpoint`: the backward pass stores one field per step and recomputes
    the four stages, so memory grows with the step count by one field, not by the ~20 FFT intermediates.
    """

    def step(carry, _):
        w, time = carry
        return (ifrk4_step(w, time, dt, rhs, decay_half), time + dt), None

    if remat:
        step = jax.checkpoint(step)
    (w_hat, t), _ = lax.scan(step, (w_hat, t), length=steps)
    return w_hat, t


def integrate_cfl(w_hat: jax.Array, t: jax.Array, t_stop: jax.Array, *, rhs: Rhs,
                  first_stage: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]], rate: jax.Array,
                  pmax: Callable[[jax.Array], jax.Array], cfl: float, dx: float,
                  dt_max: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adaptive steps dt = cfl dx / speed (capped at dt_max), the last one shortened to land exactly on t_stop.

    `first_stage(w, t)` returns (N(w, t), this device's largest sum of velocity magnitudes |u| + |v| (+ |w|)), the
    speed coming free with the transform N needs anyway; `rate` is L, `pmax` the reduction over the devices.
    Returns (w_hat, t_stop, number of steps). Not reverse-differentiable (a while loop).
    """

    def body(carry):
        w, time, count, _ = carry
        first, speed = first_stage(w, time)
        # Every device must take the same step: reduce the speed over the whole grid.
        speed = pmax(speed)
        dt = jnp.minimum(cfl * dx / jnp.maximum(speed, 1e-30), dt_max).astype(time.dtype)
        remaining = t_stop - time
        # Also absorbs a sliver left by rounding. A blown-up field (NaN speed, so NaN dt) ends the frame too: a
        # NaN compares false, and the loop would never reach t_stop; the engine's guard then halts the run.
        last = (dt >= remaining * (1 - 1e-9)) | ~jnp.isfinite(dt)
        dt = jnp.where(last, remaining, dt)
        w = ifrk4_step(w, time, dt, rhs, exp(rate * (0.5 * dt)), first_stage=first)
        return w, jnp.where(last, t_stop, time + dt), count + 1, last

    w_hat, t, count, _ = lax.while_loop(lambda c: ~c[3], body, (w_hat, t, jnp.zeros((), jnp.int32), t >= t_stop))
    return w_hat, t, count
