"""Context parallelism: each sequence split over the `context` mesh axis, attention by a ring or an all-gather.

The sharding rules map the logical `seq` axis to the `context` mesh axis (runtime/sharding.py), so every
activation, the logits and the loss are split along the sequence and need nothing special; only attention needs
keys and values from other devices. With n devices a row is cut into 2n chunks and device i holds chunks i and
2n-1-i (Megatron-LM's causal load balancing, ring-flash-attention's "zigzag"), so every device has the same
attention work. The model moves its inputs into that order (`to_balanced`) and its last hidden state back
(`from_balanced`), so logits, targets and every caller outside the model keep the natural order.

Attention (`model.context_attention`): `ring` passes key/value chunks round the ring (n - 1 `ppermute` hops),
folding them into the local queries with flash attention's online softmax, computing only the chunk pairs causality
needs, with a backward that recomputes the scores: memory never grows with T^2 and falls as 1/n. `allgather`
gathers the whole sequence's keys and values (one collective instead of n - 1 hops, but (T/n x T) scores per head in
memory), for small rings, as the Llama 3 paper trains long contexts. Masks come from the tokens' global indices and
segment ids, so RoPE positions need nothing here. Both algorithms in detail: docs/design-notes.md, this module's
section.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import spmd
from jax.sharding import PartitionSpec as P

from systolic.runtime.sharding import logical_to_spec, without_manual_axes

VARIANTS = ("ring", "allgather")  # the values of model.context_attention
_MASKED = -1e30  # finite: exp(-1e30 - m) is exactly 0 and no inf - inf appears in the corrections


class Split(NamedTuple):
    """The mesh axes that split the sequence (as a tuple) and their total size n > 1."""

    axes: tuple[str, ...]
    n: int


def current_split() -> Split | None:
    """How the current sharding rules split the sequence on the current mesh; None outside `activate(mesh)` or
    when `seq` is not split (context axis of size 1)."""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return None
    axes = logical_to_spec(("seq",), rules)[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    n = math.prod(mesh.shape[a] for a in axes)
    return Split(axes, n) if n > 1 else None


def load_balanced_order(seq_len: int, n: int) -> np.ndarray:
    """(T,) the natural index of each position of the split layout: chunks 0, 2n-1, 1, 2n-2, ... of T / 2n."""
    c = seq_len // (2 * n)
    chunks = [k for i in range(n) for k in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(k * c, (k + 1) * c) for k in chunks])


def check_seq_len(seq_len: int, split: Split | None) -> None:
    """A ConfigError, before anything compiles, when rows of seq_len tokens do not cut into 2n equal chunks."""
    if split is None or seq_len % (2 * split.n) == 0:
        return
    from systolic.errors import ConfigError

    n = split.n
    good = max(2 * n, round(seq_len / (2 * n)) * 2 * n)
    raise ConfigError(
        f"data.seq_len={seq_len} with the sequence split over {n} devices (mesh.context={n}): context parallelism cuts "
        f"each row into 2 x {n} chunks and gives device i chunks i and {2 * n - 1}-i (the causal load-balancing "
        f"order), so the length must be a multiple of {2 * n}. Fix: e.g. data.seq_len={good}, or a mesh.context "
        f"for which seq_len / (2 x mesh.context) is whole."
    )


# LAYOUT -------------------------------------------------------------------------------------------------------


def _natural(d: int, n: int) -> tuple[int, int]:
    return 2 * d, 2 * d + 1


def _balanced(d: int, n: int) -> tuple[int, int]:
    return d, 2 * n - 1 - d


def to_balanced(x: jax.Array, split: Split) -> jax.Array:
    """x (B, T, ...) in natural order, split over the sequence -> the same in the load-balanced order."""
    return _relayout(x, split, _natural, _balanced)


def from_balanced(x: jax.Array, split: Split) -> jax.Array:
    """The inverse of `to_balanced`."""
    return _relayout(x, split, _balanced, _natural)


def _relayout(x: jax.Array, split: Split, src, dst) -> jax.Array:
    """Moves x's chunks from the layout `src` to `dst` (each: device -> its two chunks). In both layouts every
    device holds one even and one odd chunk, so two collective-permutes do it, one per parity: XLA would otherwise
    gather the whole sequence onto every device to permute it."""
    axes, n = split
    rules = spmd.get_logical_axis_rules()
    spec = logical_to_spec(("batch", "seq") + (None,) * (x.ndim - 2), rules)

    def local(x):  # (b, 2c, ...)
        c = x.shape[1] // 2
        d = jax.lax.axis_index(axes)
        pieces = []
        for parity in (0, 1):
            # This device's chunk of this parity (its slot in src), sent to the device whose dst holds that chunk.
            slot = jnp.asarray([0 if src(e, n)[0] % 2 == parity else 1 for e in range(n)])[d]
            pairs = [(e, next(f for f in range(n) if k in dst(f, n))) for e in range(n) for k in src(e, n)
                     if k % 2 == parity]
            piece = jax.lax.dynamic_slice_in_dim(x, slot * c, c, axis=1)  # (b, c, ...)
            pieces.append(jax.lax.ppermute(piece, axes, pairs))
        even_first = jnp.asarray([dst(e, n)[0] % 2 == 0 for e in range(n)])[d]
        return jnp.where(even_first, jnp.concatenate(pieces, axis=1), jnp.concatenate(pieces[::-1], axis=1))

    return jax.shard_map(local, in_specs=spec, out_specs=spec)(x)


# ATTENTION ----------------------------------------------------------------------------------------------------


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *, split: Split,
              variant: str, window: int = 0) -> jax.Array:
    """Causal grouped-query attention of sequences in the load-balanced order, split over `split.axes`: q (B, T,
    H, hd), k and v (B, T, KV, hd), segment_ids (B, T) or None -> (B, T, H, hd). Runs per device in a shard_map over
    the current rules' batch, seq and head axes (the head split of tensor parallelism keeps whole query groups, as
    the rules split `heads` and `kv_heads` over the same axes)."""
    assert variant in VARIANTS, variant
    rules = spmd.get_logical_axis_rules()
    # Inside a pipeline's shard_map (lm/parallel/pipeline.py) its manual axes (stage, data) are already split off.
    q_spec = without_manual_axes(logical_to_spec(("batch", "seq", "heads", "head_dim"), rules))
    kv_spec = without_manual_axes(logical_to_spec(("batch", "seq", "kv_heads", "head_dim"), rules))
    seg_spec = P(q_spec[0], q_spec[1])
    local = functools.partial(ring_attention if variant == "ring" else allgather_attention, split=split,
                              window=window)
    if segment_ids is None:
        return jax.shard_map(lambda q, k, v: local(q, k, v, None), in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec)(q, k, v)
    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec)(q, k, v, segment_ids)


class _Ring(NamedTuple):  # the static part of a ring attention call
    axes: tuple[str, ...]
    n: int
    window: int


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *, split: Split,
                   window: int = 0) -> jax.Array:
    """One device's part of ring attention, inside shard_map: its 2c queries q (B, 2c, H, hd), keys and values
    (B, 2c, KV, hd) and segment ids (B, 2c) or None, chunks i and 2n-1-i of the row -> (B, 2c, H, hd)."""
    qs, ks, vs, seg = _chunked(q, k, v, segment_ids)
    out = _ring(qs, ks, vs, seg, _Ring(split.axes, split.n, window))  # (B, KV, G, 2, c, hd)
    return _unchunked(out, q.shape)


def allgather_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *, split: Split,
                        window: int = 0) -> jax.Array:
    """`ring_attention`'s contract with the keys and values gathered whole: the local queries (2c) against all T
    keys in one masked softmax (differentiated by JAX: the gathers' transposes reduce-scatter dk and dv)."""
    axes, n = split
    B, L, H, hd = q.shape
    KV = k.shape[2]
    d = jax.lax.axis_index(axes)
    q5 = (q * (1.0 / math.sqrt(hd))).reshape(B, L, KV, H // KV, hd).transpose(0, 2, 3, 1, 4)  # (B, KV, G, 2c, hd)
    # (B, KV, T, hd) each: every device's block, in device order, which is the load-balanced order
    k_all, v_all = (jax.lax.all_gather(a, axes, axis=1, tiled=True).transpose(0, 2, 1, 3) for a in (k, v))
    seg_all = None if segment_ids is None else jax.lax.all_gather(segment_ids, axes, axis=1, tiled=True)  # (B, T)
    q_idx = jnp.concatenate([_chunk_index(d, s, n, L // 2) for s in (0, 1)])  # (2c,)
    k_idx = jnp.asarray(load_balanced_order(n * L, n))  # (T,): the gathered blocks are the devices' in order
    acc = _empty(q5.shape)
    o, _, l = _attend(acc, q5, k_all, v_all, q_idx, k_idx, segment_ids, seg_all, window)
    out = (o / l[..., None]).astype(q.dtype)  # (B, KV, G, 2c, hd)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, L, H, hd)


def _chunked(q, k, v, segment_ids):
    """Per-device arrays with the two chunks on their own axis, heads in front and queries pre-scaled:
    q (B, 2c, H, hd) -> (B, KV, G, 2, c, hd); k, v (B, 2c, KV, hd) -> (B, KV, 2, c, hd); ids (B, 2c) -> (B, 2, c)."""
    B, L, H, hd = q.shape
    KV = k.shape[2]
    c = L // 2
    qs = (q * (1.0 / math.sqrt(hd))).reshape(B, 2, c, KV, H // KV, hd).transpose(0, 3, 4, 1, 2, 5)
    ks, vs = (a.reshape(B, 2, c, KV, hd).transpose(0, 3, 1, 2, 4) for a in (k, v))
    seg = None if segment_ids is None else segment_ids.reshape(B, 2, c)
    return qs, ks, vs, seg


def _unchunked(out, shape):
    """(B, KV, G, 2, c, hd) -> (B, 2c, H, hd)."""
    return out.transpose(0, 3, 4, 1, 2, 5).reshape(shape)


def _chunk_index(device, slot, n: int, c: int) -> jax.Array:
    """(c,) the global indices of chunk `slot` (0 or 1) of `device` in the load-balanced order."""
    chunk = jnp.where(slot == 0, device, 2 * n - 1 - device)
    return chunk * c + jnp.arange(c)


def _allowed(q_idx, k_idx, q_seg, k_seg, window: int) -> jax.Array:
    """(B or 1, 1, 1, Q, S) bool: key at or before the query, within the window, in the same document."""
    allowed = k_idx[None, :] <= q_idx[:, None]  # (Q, S)
    if window:
        allowed &= k_idx[None, :] > q_idx[:, None] - window
    allowed = allowed[None]  # (1, Q, S)
    if q_seg is not None:
        allowed = allowed & (q_seg[:, :, None] == k_seg[:, None, :])  # (B, Q, S)
    return allowed[:, None, None]


def _empty(q_shape) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online-softmax state for queries of q_shape (..., Q, hd): o (..., Q, hd), m and l (..., Q), float32."""
    return (jnp.zeros(q_shape, jnp.float32), jnp.full(q_shape[:-1], _MASKED, jnp.float32),
            jnp.zeros(q_shape[:-1], jnp.float32))


def _attend(acc, q, k, v, q_idx, k_idx, q_seg, k_seg, window: int):
    """Folds keys k and values v (B, KV, S, hd) into the online-softmax state `acc` of queries q (B, KV, G, Q, hd)."""
    o, m, l = acc
    s = jnp.einsum("bkgqd,bksd->bkgqs", q, k, preferred_element_type=jnp.float32)  # (B, KV, G, Q, S)
    allowed = _allowed(q_idx, k_idx, q_seg, k_seg, window)
    s = jnp.where(allowed, s, _MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1))  # (B, KV, G, Q)
    # where, not exp alone: a row with no allowed key in this block (m_new = _MASKED) must add nothing.
    p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)  # (B, KV, G, Q, S) float32
    correction = jnp.exp(m - m_new)
    l = l * correction + p.sum(axis=-1)
    o = o * correction[..., None] + jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), v,
                                               preferred_element_type=jnp.float32)
    return o, m_new, l


def _slot(x, slot, axis: int):
    return jax.lax.dynamic_index_in_dim(x, slot, axis, keepdims=False)


def _put(x, value, slot, axis: int):
    return jax.lax.dynamic_update_index_in_dim(x, value, slot, axis)


def _hop_pairs(i, s: int | jax.Array, n: int):
    """The (query chunk, key chunk) pairs that the block of device j = i - s needs: all for j = i (step 0, causal
    within), else (0, 0) and (1, 0) for an earlier device and (1, 0) and (1, 1) for a later one."""
    if isinstance(s, int) and s == 0:
        return ((0, 0), (1, 0), (1, 1))
    later = (jnp.mod(i - s, n) > i).astype(jnp.int32)
    return ((later, 0), (1, later))


def _rotate(tree, ring: _Ring):
    """Every array of `tree` sent to the next device on the ring."""
    pairs = [(d, (d + 1) % ring.n) for d in range(ring.n)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, ring.axes, pairs), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(q, k, v, seg, ring: _Ring):
    return _ring_forward(q, k, v, seg, ring)[0]


QUERY_BLOCK = 256  # queries per score block within a chunk pair: memory holds (QUERY_BLOCK x c) scores per head


def query_blocks(c: int) -> int:
    """How many blocks a chunk's c queries are cut into: blocks of QUERY_BLOCK (or c, when it does not divide)."""
    return c // QUERY_BLOCK if c % QUERY_BLOCK == 0 else 1


def _blocked(x, axis: int, nb: int):
    """x with its query axis `axis` cut into nb blocks, the block index moved to the front."""
    shape = x.shape[:axis] + (nb, x.shape[axis] // nb) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocked(x, axis: int):
    """The inverse of `_blocked`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _pair_forward(acc, q, k, v, q_idx, k_idx, q_seg, k_seg, window: int):
    """`_attend` of one (query chunk, key chunk) pair, query block by query block (lax.map: one block's scores
    in memory at a time). acc and q on chunk axes (B, KV, G, c[, hd]), q_idx (c,), q_seg (B, c) or None."""
    nb = query_blocks(q.shape[3])
    if nb == 1:
        return _attend(acc, q, k, v, q_idx, k_idx, q_seg, k_seg, window)

    def one(xs):
        acc, q, q_idx, q_seg = xs
        return _attend(acc, q, k, v, q_idx, k_idx, q_seg, k_seg, window)

    xs = (tuple(_blocked(a, 3, nb) for a in acc), _blocked(q, 3, nb), q_idx.reshape(nb, -1),
          None if q_seg is None else _blocked(q_seg, 1, nb))
    return tuple(_unblocked(a, 3) for a in jax.lax.map(one, xs))


def _pair_backward(q, k, v, d_out, lse, delta, q_idx, k_idx, q_seg, k_seg, window: int):
    """Flash attention's backward for one (query chunk, key chunk) pair, query block by query block: ->
    (dq (B, KV, G, c, hd), dk and dv (B, KV, c, hd)), float32."""

    def one(d_kv, xs):
        q, d_out, lse, delta, q_idx, q_seg = xs
        scores = jnp.einsum("bkgqd,bksd->bkgqs", q, k, preferred_element_type=jnp.float32)
        allowed = _allowed(q_idx, k_idx, q_seg, k_seg, window)
        p = jnp.where(allowed, jnp.exp(scores - lse[..., None]), 0.0)  # (B, KV, G, Q, S)
        d_p = jnp.einsum("bkgqd,bksd->bkgqs", d_out, v, preferred_element_type=jnp.float32)
        d_s = (p * (d_p - delta[..., None])).astype(q.dtype)
        d_v = jnp.einsum("bkgqs,bkgqd->bksd", p.astype(d_out.dtype), d_out, preferred_element_type=jnp.float32)
        d_k = jnp.einsum("bkgqs,bkgqd->bksd", d_s, q, preferred_element_type=jnp.float32)
        d_q = jnp.einsum("bkgqs,bksd->bkgqd", d_s, k, preferred_element_type=jnp.float32)
        return (d_kv[0] + d_k, d_kv[1] + d_v), d_q

    nb = query_blocks(q.shape[3])
    zeros = jnp.zeros_like(k, jnp.float32)  # like k: varying over the ring's axes, as the scan's carry must be
    xs = (q, d_out, lse, delta, q_idx, q_seg)
    if nb == 1:
        (d_k, d_v), d_q = one((zeros, zeros), xs)
        return d_q, d_k, d_v
    xs = (*(_blocked(a, 3, nb) for a in xs[:4]), q_idx.reshape(nb, -1),
          None if q_seg is None else _blocked(q_seg, 1, nb))
    (d_k, d_v), d_q = jax.lax.scan(one, (zeros, zeros), xs)
    return _unblocked(d_q, 3), d_k, d_v


def _ring_forward(q, k, v, seg, ring: _Ring):
    """q (B, KV, G, 2, c, hd), k and v (B, KV, 2, c, hd), seg (B, 2, c) or None -> (out like q, log-normaliser
    (B, KV, G, 2, c) float32)."""
    i = jax.lax.axis_index(ring.axes)
    c = q.shape[4]

    def fold(acc, k, v, k_seg, s):
        j = jnp.mod(i - s, ring.n)  # whose keys these are
        for qs, ks in _hop_pairs(i, s, ring.n):
            part = tuple(_slot(a, qs, 3) for a in acc)
            part = _pair_forward(part, _slot(q, qs, 3), _slot(k, ks, 2), _slot(v, ks, 2),
                                 _chunk_index(i, qs, ring.n, c), _chunk_index(j, ks, ring.n, c),
                                 None if seg is None else _slot(seg, qs, 1),
                                 None if k_seg is None else _slot(k_seg, ks, 1), ring.window)
            acc = tuple(_put(a, p, qs, 3) for a, p in zip(acc, part))
        return acc

    def hop(s, carry):
        acc, kv = carry
        kv = _rotate(kv, ring)
        return fold(acc, *kv, s), kv

    acc = fold(_empty(q.shape), k, v, seg, 0)
    o, m, l = jax.lax.fori_loop(1, ring.n, hop, (acc, (k, v, seg)))[0]
    return (o / l[..., None]).astype(q.dtype), m + jnp.log(l)


def _ring_fwd(q, k, v, seg, ring: _Ring):
    out, lse = _ring_forward(q, k, v, seg, ring)
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(ring: _Ring, residuals, d_out):
    """Flash attention's backward, blockwise round the ring: dk and dv travel with their keys and values and come
    home after the n-th hop."""
    q, k, v, seg, out, lse = residuals
    i = jax.lax.axis_index(ring.axes)
    c = q.shape[4]
    # sum_s(dP * P) = sum_d(dO * O): the softmax backward's reduction over hd instead of over the keys.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # (B, KV, G, 2, c)

    def fold(d_q, k, v, k_seg, d_k, d_v, s):
        j = jnp.mod(i - s, ring.n)
        for qs, ks in _hop_pairs(i, s, ring.n):
            dq_part, dk_part, dv_part = _pair_backward(
                _slot(q, qs, 3), _slot(k, ks, 2), _slot(v, ks, 2), _slot(d_out, qs, 3), _slot(lse, qs, 3),
                _slot(delta, qs, 3), _chunk_index(i, qs, ring.n, c), _chunk_index(j, ks, ring.n, c),
                None if seg is None else _slot(seg, qs, 1), None if k_seg is None else _slot(k_seg, ks, 1),
                ring.window)
            d_q = _put(d_q, _slot(d_q, qs, 3) + dq_part, qs, 3)
            d_k = _put(d_k, _slot(d_k, ks, 2) + dk_part, ks, 2)
            d_v = _put(d_v, _slot(d_v, ks, 2) + dv_part, ks, 2)
        return d_q, d_k, d_v

    def hop(s, carry):
        d_q, block = carry
        k, v, k_seg, d_k, d_v = _rotate(block, ring)
        d_q, d_k, d_v = fold(d_q, k, v, k_seg, d_k, d_v, s)
        return d_q, (k, v, k_seg, d_k, d_v)

    zeros = lambda a: jnp.zeros(a.shape, jnp.float32)  # noqa: E731
    d_q, d_k, d_v = fold(zeros(q), k, v, seg, zeros(k), zeros(v), 0)
    d_q, (_, _, _, d_k, d_v) = jax.lax.fori_loop(1, ring.n, hop, (d_q, (k, v, seg, d_k, d_v)))
    d_k, d_v = _rotate((d_k, d_v), ring)  # the n-th hop: each block's gradients back to the device that owns it
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)
