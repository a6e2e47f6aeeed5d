"""CPU-only formulations of the transformer's hot spots, each measured against PyTorch on the same CPU.

On GPU/TPU every function here is the plain formulation (`cpu_tweak` is False there). On XLA:CPU four rewrites
train faster (attempts and figures: docs/benchmarks.md, `benchmarks/peers/lm_vs_pytorch.py`): `project` (matmuls on
activations flattened to (B*T, D), so the weight gradient contracts over one axis), `causal_attention` (both dots as
plain batched matmuls, an additive causal bias, a hand-written backward), `gradient_barrier` (an identity on the
residual stream whose backward XLA's fusion pass cannot see through) and `tile_layout` (MoE groups padded to whole
tiles, since XLA:CPU computes `jax.lax.ragged_dot` over all rows for every group). Why each is faster:
docs/design-notes.md, this module's section.

`SYSTOLIC_CPU_TWEAKS` (comma-separated names, `all` or `none`; default `all`) switches them for ablations,
read once into `runtime/cpu_settings.settings()`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from systolic.runtime import cpu_settings
from systolic.runtime.platform import compile_platform
from systolic.workloads.lm.parallel import context

REWRITES = ("flatten", "attention", "barrier", "grouped")


def cpu_tweak(name: str) -> bool:
    """Whether the CPU rewrite `name` (one of REWRITES) is on: only when compiling for the CPU (not when
    `systolic plan` traces for a TPU or GPU on a CPU host), and as the CPU tuning says."""
    assert name in REWRITES, name
    return compile_platform() == "cpu" and getattr(cpu_settings.settings(), name)


def project(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """Contracts the last `contract` axes of x with the first `contract` axes of w: (*lead, *k) @ (*k, *out)."""
    # Not with the sequence split (context parallelism): rows of (B, T) split over both batch and context axes are
    # no contiguous block of B*T, so XLA would gather the whole sequence to flatten it.
    if not cpu_tweak("flatten") or context.current_split() is not None:
        return jnp.tensordot(x, w, axes=contract)
    lead, k, out = x.shape[: x.ndim - contract], math.prod(w.shape[:contract]), w.shape[contract:]
    y = x.reshape(-1, k) @ w.reshape(k, -1)  # (prod(lead), prod(out))
    return y.reshape(*lead, *out)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                     window: int = 0) -> jax.Array:
    """Causal grouped-query attention: q (B, T, H, hd), k and v (B, T, KV, hd) -> (B, T, H, hd); with
    `segment_ids` (B, T) a query attends only to keys of its own segment, with `window` W > 0 only to keys at most
    W - 1 positions before it.

    Heads go in front before the dots, and a query group shares its key/value head by stacking the group's
    queries along the query axis, so both dots are plain batched matmuls over (B, KV) that XLA:CPU runs without
    relayout copies; the backward is written out (`_attention_core`)."""
    B, T, H, hd = q.shape
    KV = k.shape[2]
    G = H // KV
    q = (q * (1.0 / math.sqrt(hd))).reshape(B, T, KV, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KV, G * T, hd)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, KV, T, hd)
    # -1e30 rather than -inf: exp underflows to exactly 0 and no inf - inf appears in the backward pass.
    causal = jnp.tril(jnp.ones((T, T), bool))  # (T, T)
    if window:
        causal = causal & jnp.triu(jnp.ones((T, T), bool), -(window - 1))  # query - key <= window - 1
    if segment_ids is None:
        bias = jnp.tile(jnp.where(causal, 0.0, -1e30).astype(q.dtype), (G, 1))  # (G*T, T)
    else:
        allowed = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])  # (B, T, T)
        bias = jnp.tile(jnp.where(allowed, 0.0, -1e30).astype(q.dtype)[:, None], (1, 1, G, 1))  # (B, 1, G*T, T)
    out = _attention_core(q, k, v, bias)  # (B, KV, G*T, hd)
    return out.reshape(B, KV, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)


def _attention_forward(q, k, v, bias):
    """q (B, KV, Q, hd), k and v (B, KV, S, hd), bias (Q, S) or (B, 1, Q, S) -> out (B, KV, Q, hd) and probs
    (B, KV, Q, S)."""
    # bias is in the compute dtype; the mask is added to the float32 scores, as the softmax runs in float32.
    scores = jnp.einsum("bkqd,bksd->bkqs", q, k).astype(jnp.float32) + bias.astype(jnp.float32)  # (B, KV, Q, S)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkqs,bksd->bkqd", probs, v), probs


@jax.custom_vjp
def _attention_core(q, k, v, bias):
    return _attention_forward(q, k, v, bias)[0]


def _attention_core_fwd(q, k, v, bias):
    out, probs = _attention_forward(q, k, v, bias)
    return out, (q, k, v, probs, out)


def _attention_core_bwd(res, d_out):
    q, k, v, probs, out = res
    d_v = jnp.einsum("bkqs,bkqd->bksd", probs, d_out)  # (B, KV, S, hd)
    d_probs = jnp.einsum("bkqd,bksd->bkqs", d_out, v)  # (B, KV, Q, S)
    # Softmax backward with sum_s(d_probs * probs) = sum_d(d_out * out): a reduction over hd, not over S.
    delta = jnp.sum((d_out * out).astype(jnp.float32), axis=-1, keepdims=True)  # (B, KV, Q, 1)
    d_scores = (probs.astype(jnp.float32) * (d_probs.astype(jnp.float32) - delta)).astype(q.dtype)
    d_q = jnp.einsum("bkqs,bksd->bkqd", d_scores, k)
    d_k = jnp.einsum("bkqs,bkqd->bksd", d_scores, q)
    return d_q, d_k, d_v, None


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


@jax.custom_vjp
def gradient_barrier(x: jax.Array) -> jax.Array:
    """The identity, forward and backward; XLA cannot fuse across its backward (see the module docstring)."""
    return x


def _barrier_fwd(x: jax.Array):
    return x, None


def _barrier_bwd(_, g: jax.Array):
    # A loop whose trip count is only known at run time: `optimization_barrier` would not do (XLA:CPU removes
    # it before fusion), nor would a loop whose body simplifies to the identity. The count is 0 unless g[0] is
    # NaN, and then the body runs once with i = 0, multiplying by 1: the identity, but not one XLA can prove.
    trips = jnp.isnan(g.reshape(-1)[0]).astype(jnp.int32)
    return (jax.lax.fori_loop(0, trips, lambda i, c: c * (i + 1).astype(c.dtype), g),)


gradient_barrier.defvjp(_barrier_fwd, _barrier_bwd)


class Tiles(NamedTuple):
    """Where rows sorted by group go when each group is padded to whole tiles of `size` rows (`tile_layout`)."""

    dest: jax.Array  # (R,) each row's place among the tiles' rows; rows past the groups: out of range
    group: jax.Array  # (tiles,) each tile's group
    size: int


def tile_layout(group_sizes: jax.Array, rows: int) -> Tiles:
    """The tiling of `rows` rows sorted into len(group_sizes) groups: each group padded to whole tiles (at most
    G * (t - 1) padding rows in all), so every tile belongs to one group."""
    g = group_sizes.shape[0]
    t = min(64, max(8, 1 << max(0, (rows // (2 * g)).bit_length() - 1)))  # a power of two near half a group, in [8, 64]
    tiles = -(-(rows + g * (t - 1)) // t)  # enough for any group sizes
    padded = -(-group_sizes // t) * t  # (G,) each group's rows rounded up to whole tiles
    start, padded_start = jnp.cumsum(group_sizes) - group_sizes, jnp.cumsum(padded) - padded  # (G,) each
    row = jnp.arange(rows)
    group = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), row, side="right"), g - 1)  # (R,)
    dest = jnp.where(row < jnp.sum(group_sizes), padded_start[group] + row - start[group], tiles * t)  # (R,)
    tile_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(tiles) * t, side="right"), g - 1)
    return Tiles(dest, tile_group, t)


def to_tiles(x: jax.Array, tiles: Tiles) -> jax.Array:
    """x (R, K) sorted by group -> (tiles, t, K), padding rows zero."""
    n = tiles.group.shape[0]
    return jnp.zeros((n * tiles.size, x.shape[-1]), x.dtype).at[tiles.dest].set(x, mode="drop").reshape(n, tiles.size, -1)


def from_tiles(y: jax.Array, tiles: Tiles) -> jax.Array:
    """(tiles, t, N) -> (R, N) in the rows' order, rows past the groups zero."""
    return y.reshape(-1, y.shape[-1]).at[tiles.dest].get(mode="fill", fill_value=0)


def tiled_matmul(x: jax.Array, w: jax.Array, tiles: Tiles) -> jax.Array:
    """x (tiles, t, K) @ its tiles' groups' matrices of w (G, K, N) -> (tiles, t, N): one batched matmul. The
    gathered matrices are materialised (an optimisation barrier): fused into the dot, the gather made XLA:CPU run
    it as a slow loop (about 1.7x the time of the whole SwiGLU, measured with benchmarks/studies/moe.py's sizes)."""
    return jnp.einsum("ntk,nkm->ntm", x, jax.lax.optimization_barrier(w[tiles.group]))
