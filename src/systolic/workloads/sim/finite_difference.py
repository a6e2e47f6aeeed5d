"""Finite differences on a periodic grid split into blocks over the mesh, with halo exchange.

Layout: rows (x) split over the `data` mesh axis, columns (y) over `stage` x `fsdp` x `expert` x `context` x `tensor` (see
`BLOCK_AXES`), so a
mesh of data=8 is a 1-D strip decomposition and data=2, fsdp=2, tensor=2 a 2-D one. The 5-point Laplacian
needs one neighbouring cell on each side: before every evaluation each device sends its edge rows/columns to
its neighbours with `lax.ppermute` (a ring, so the wrap-around gives periodic boundaries) and pads its block
with what it receives. Along an axis that is not split the halo is the block's own opposite edge. The
arithmetic is the same in every layout, so any decomposition gives bit-identical results to one device.

Time stepping is explicit Euler: with dt proportional to dx^2 (the diffusive limit dx^2 / (4 D) sets it) its
O(dt) error is O(dx^2), the same order as the Laplacian's, so the whole scheme converges at second order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

BLOCK_AXES: tuple[tuple[str, ...], tuple[str, ...]] = (("data",), ("stage", "fsdp", "expert", "context", "tensor"))  # grid rows, grid columns


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How an n x n grid is split: `parts[i]` blocks along grid axis i, over mesh axes `axes[i]`."""

    n: int
    axes: tuple[tuple[str, ...], tuple[str, ...]]
    parts: tuple[int, int]

    @property
    def spec(self) -> P:
        return P(self.axes[0], self.axes[1])

    def psum(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, self.axes[0] + self.axes[1])

    def pmax(self, x: jax.Array) -> jax.Array:
        return lax.pmax(x, self.axes[0] + self.axes[1])

    def block_origin(self) -> tuple[jax.Array, jax.Array]:
        """Global index of this device's first row and column (inside shard_map; varies over every block axis,
        even one of size 1, so values computed from it can be reduced over all of them)."""
        rows, cols = (self.n // p for p in self.parts)
        return lax.axis_index(self.axes[0]) * rows, lax.axis_index(self.axes[1]) * cols


def exchange_halo(f: jax.Array, axis: int, mesh_axes: tuple[str, ...], parts: int) -> jax.Array:
    """Pads `f` with one cell on both sides of `axis`: the neighbouring blocks' edge cells (periodic).

    (..., m, ...) -> (..., m + 2, ...). Device i receives device i-1's last cell as its lower halo and device
    i+1's first cell as its upper halo; the ring closes at the ends, which is the periodic boundary.
    """
    first = lax.slice_in_dim(f, 0, 1, axis=axis)
    last = lax.slice_in_dim(f, f.shape[axis] - 1, f.shape[axis], axis=axis)
    if parts == 1:
        lower, upper = last, first  # the whole axis is here: wrap around locally
    else:
        lower = lax.ppermute(last, mesh_axes, perm=[(i, (i + 1) % parts) for i in range(parts)])
        upper = lax.ppermute(first, mesh_axes, perm=[(i, (i - 1) % parts) for i in range(parts)])
    return jnp.concatenate([lower, f, upper], axis=axis)


def laplacian(f: jax.Array, blocks: Blocks, dx: float) -> jax.Array:
    """5-point Laplacian of the last two axes of f (..., rows, cols), second order in dx."""
    rows = exchange_halo(f, f.ndim - 2, blocks.axes[0], blocks.parts[0])  # (..., rows + 2, cols)
    cols = exchange_halo(f, f.ndim - 1, blocks.axes[1], blocks.parts[1])  # (..., rows, cols + 2)
    d2x = rows[..., :-2, :] + rows[..., 2:, :] - 2 * f
    d2y = cols[..., :, :-2] + cols[..., :, 2:] - 2 * f
    return (d2x + d2y) / (dx * dx)


def heat_step(u: jax.Array, dt: jax.Array, *, diffusivity: float, blocks: Blocks, dx: float) -> jax.Array:
    return u + dt * diffusivity * laplacian(u, blocks, dx)


def gray_scott_step(uv: jax.Array, dt: jax.Array, *, feed: float, kill: float, diffusion_u: float,
                    diffusion_v: float, blocks: Blocks, dx: float) -> jax.Array:
    """One Euler step of Gray-Scott; uv is (2, rows, cols) so both fields share one halo exchange."""
    lap = laplacian(uv, blocks, dx)  # (2, rows, cols)
    u, v = uv[0], uv[1]
    uvv = u * v * v
    du = diffusion_u * lap[0] - uvv + feed * (1 - u)
    dv = diffusion_v * lap[1] + uvv - (feed + kill) * v
    return uv + dt * jnp.stack([du, dv])


def integrate(f: jax.Array, dt: jax.Array, steps: int, step_fn) -> jax.Array:
    """`steps` applications of `step_fn(f, dt)` in one `fori_loop`."""
    return lax.fori_loop(0, steps, lambda _, x: step_fn(x, dt), f)
