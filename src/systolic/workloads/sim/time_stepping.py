"""Time integration shared by the spectral solvers (2-D vorticity, 3-D velocity): Lawson's integrating-factor RK4
with fixed steps (a differentiable `lax.scan`) or CFL-chosen steps (a `lax.while_loop`).

The equation is u_t = L u + N(u, t) with a diagonal linear part L (viscosity, drag) that the integrating factor
exp(L dt) solves exactly, so the step size is limited by the nonlinear term only. The solvers hand in N (`rhs`)
and exp(L dt / 2) (`decay_half`); u is any complex array that the real decay factor broadcasts against.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

Rhs = Callable[[jax.Array, jax.Array], jax.Array]  # (u, t) -> N(u, t)


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
        w = ifrk4_step(w, time, dt, rhs, jnp.exp(rate * (0.5 * dt)), first_stage=first)
        return w, jnp.where(last, t_stop, time + dt), count + 1, last

    w_hat, t, count, _ = lax.while_loop(lambda c: ~c[3], body, (w_hat, t, jnp.zeros((), jnp.int32), t >= t_stop))
    return w_hat, t, count
