"""Muon (Keller Jordan, 2024): momentum orthogonalised by a Newton-Schulz iteration, for weight matrices.

The update of a matrix W (fan_in, fan_out) is the Nesterov momentum's "orthogonal part": for M = U S V^T, about
U V^T (the polar factor), reached without an SVD by five steps of Keller Jordan's quintic iteration with
modded-nanogpt's coefficients, tuned for speed: the singular values land near 1, not on it.

Why not `optax.contrib.muon`: it runs the iteration on the momentum as the parameter is sharded, and GSPMD then
all-gathers the whole matrix (and all-reduces its products) in each of the five steps. Here each matrix is gathered
once and the iteration runs whole on every device (`_orthogonalize_whole`): one all-gather of the hidden matrices
per step, no all-reduce, and the iteration's FLOPs repeated on every device (docs/optimizers.md, "Muon on a mesh").

Weights with more than two axes are read as matrices by `Dims` (which axes are fan-in, which fan-out, counted from
the end; any axis before them, such as scan_layers' `layers`, is a batch of separate matrices). The iteration, its
coefficients and their spread, and the comparison with optax: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (modded-nanogpt); also Optax's default
NS_STEPS = 5


class Dims(NamedTuple):
    """How Muon reads a weight as a batch of (fan_in, fan_out) matrices: its fan-in and fan-out axes, negative
    (counted from the end); the axes before them are the batch."""

    fan_in: tuple[int, ...]
    fan_out: tuple[int, ...]

    def fans(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return math.prod(shape[a] for a in self.fan_in), math.prod(shape[a] for a in self.fan_out)


class MuonState(NamedTuple):
    mu: Any  # the momentum, in the transform's moment_dtype (float32 by default), laid out as the parameters


def orthogonalize(x: jax.Array) -> jax.Array:
    """Newton-Schulz's approximation of the polar factor of each matrix of x (..., m, n), float32."""
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:  # iterate on the short side: A = X X^T is (min, min)
        x = jnp.swapaxes(x, -1, -2)
    # Divided by the Frobenius norm, every singular value is <= 1, inside the iteration's basin.
    x = x / (jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)) + 1e-7)
    a, b, c = NS_COEFFS
    for _ in range(NS_STEPS):
        gram = x @ jnp.swapaxes(x, -1, -2)  # (..., m, m)
        x = a * x + (b * gram + c * gram @ gram) @ x  # (..., m, n)
    return jnp.swapaxes(x, -1, -2) if transpose else x


def as_matrices(x: jax.Array, dims: Dims) -> jax.Array:
    """x (*batch, *fan_in, *fan_out) with the axes in `dims` in that order (ours are) -> (batch, fan_in, fan_out)."""
    fan_in, fan_out = dims.fans(x.shape)
    assert x.shape[x.ndim - len(dims.fan_in) - len(dims.fan_out):] == tuple(
        x.shape[a] for a in (*dims.fan_in, *dims.fan_out)), (x.shape, dims)
    return x.reshape(-1, fan_in, fan_out)


def shape_scale(fan_in: int, fan_out: int, rule: Literal["keller", "spectral"]) -> float:
    """The factor on an orthogonalised update of a (fan_in, fan_out) matrix. `keller`: sqrt(max(1, fan_out /
    fan_in)), Keller Jordan's Muon (tall matrices get more). `spectral`: sqrt(fan_out / fan_in), the spectral
    condition for feature learning (Yang, Simon and Bernstein 2023): the update's RMS-to-RMS operator norm is then
    the learning rate whatever the width and aspect ratio, as muP asks of a hidden layer."""
    ratio = fan_out / fan_in
    return math.sqrt(max(1.0, ratio) if rule == "keller" else ratio)


def _orthogonalize_whole(x: jax.Array) -> jax.Array:
    """`orthogonalize` of x (batch, m, n) with every matrix whole on every device: one all-gather of x (GSPMD's,
    from the parameter's layout), the iteration run locally, and the result sliced back to the parameter's layout
    for free. A shard_map, not a sharding constraint: through a mere constraint GSPMD carries the parameter's layout
    into the iteration and partitions its matmuls again (measured: more all-gathers than without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return orthogonalize(x)
    return jax.shard_map(orthogonalize, mesh=mesh, in_specs=P(), out_specs=P())(x)


def scale_by_muon(dims: Callable[[Any], Any], *, momentum: float, rule: Literal["keller", "spectral"],
                  moment_dtype: Any = jnp.float32) -> optax.GradientTransformation:
    """Gradients -> orthogonalised Nesterov momentum times `shape_scale`, for parameters that `dims(tree)` maps to
    `Dims` (use it on exactly those, e.g. inside `optax.partition`). Keller Jordan's momentum: M <- beta M +
    (1 - beta) G, then the direction is (1 - beta) G + beta M. The momentum is stored in `moment_dtype` and updated
    in float32 (read up, updated, the direction taken from the float32 value, rounded back for storage)."""

    def init(params):
        return MuonState(mu=jax.tree.map(lambda p: jnp.zeros(p.shape, moment_dtype), params))

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: momentum * m.astype(jnp.float32) + (1 - momentum) * g, state.mu, updates)

        def one(g, m, d):
            nesterov = (1 - momentum) * g + momentum * m  # laid out as the parameter
            x = as_matrices(nesterov, d)  # (batch, fan_in, fan_out)
            o = _orthogonalize_whole(x) * shape_scale(x.shape[1], x.shape[2], rule)
            return o.reshape(g.shape).astype(g.dtype)  # sliced back to the parameter's layout by GSPMD

        is_dims = lambda x: isinstance(x, Dims)  # noqa: E731
        stored = jax.tree.map(lambda m: m.astype(moment_dtype), mu)
        return jax.tree.map(one, updates, mu, dims(updates), is_leaf=is_dims), MuonState(mu=stored)

    return optax.GradientTransformation(init, update)
