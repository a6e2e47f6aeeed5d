"""Mixture-of-experts MLP math (model.moe): the float32 router, its auxiliary losses, and the two dispatches,
each also expert-parallel over the `expert` mesh axis.

Routing (Mixtral, Qwen-MoE, GPT-OSS): softmax over the router's float32 logits, the top k experts per token, their
probabilities renormalised when `norm_topk_prob`; the token's output is the weighted sum of its k experts' SwiGLU
outputs. Two dispatches: dropless (default) sorts the token-expert assignments by expert into one grouped matmul
(`jax.lax.ragged_dot`; tiles on CPU, lm/model/cpu.py) and drops nothing; capacity (`capacity_factor` > 0,
GShard/Switch) gives each expert C slots per sequence, filled first-choice first, moved by one-hot einsums. Rows
change order only by `move_rows`, a gather in both passes, because a scatter of whole rows made the TPU compiler's
backend take minutes per layer (docs/planning.md, "Compile time of MoE models").

Expert parallelism (`experts_forward`): the dispatch runs inside `shard_map`, each device on its own rows of the
batch with the experts split over `expert`; one `all_to_all` in fixed worst-case slots sends rows to their experts'
devices and a second brings the results back. Expert weights enter gathered over fsdp (each device gathers only its
own experts) and stay split over `tensor`. GPT-OSS's biases and clamp, the capacity formula and the slot sizes:
docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax.core import spmd
from jax.sharding import PartitionSpec as P

from systolic.runtime.sharding import logical_to_spec
from systolic.workloads.lm.model import cpu
from systolic.workloads.lm.model.sections import MoeConfig


class Routing(NamedTuple):
    """The router's choice for tokens among E experts; `...` is the tokens' axes: (N,), or (B, T) in the model,
    which keeps them unflattened so a sequence split over the context axis stays split."""

    experts: jax.Array  # (..., k) int32, distinct per token, best first
    weights: jax.Array  # (..., k) float32, the mixing weights of those experts
    logits: jax.Array  # (..., E) float32


class MoeStats(NamedTuple):
    """What a MoE layer reports (a model's: the MoE layers' stacked along a leading axis)."""

    aux_loss: jax.Array  # () float32: E * sum_e f_e P_e, 1.0 for a balanced router (Switch Transformer eq. 4)
    z_loss: jax.Array  # () float32: mean over tokens of logsumexp(logits)^2 (ST-MoE)
    load: jax.Array  # (E,) float32: each expert's share f_e of the N*k assignments (sums to 1)
    dropped: jax.Array  # () float32: the share of assignments over capacity (0 when dropless)


def route(x: jax.Array, w_router: jax.Array, top_k: int, norm_topk_prob: bool, *,
          bias: jax.Array | None = None) -> Routing:
    """x (..., D) any dtype, w_router (D, E) float32, optional bias (E,) float32 on the logits -> the routing,
    computed in float32 at full precision: the softmax and the top-k choice are sensitive to bf16 rounding of the
    logits. (GPT-OSS's softmax over the top k logits is the renormalised top k of the softmax: norm_topk_prob.)"""
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), w_router,
                        precision=jax.lax.Precision.HIGHEST)  # (..., E)
    if bias is not None:
        logits = logits + bias
    probs = jax.nn.softmax(logits, axis=-1)  # (..., E)
    top, experts = jax.lax.top_k(probs, top_k)  # (..., k) each
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), top, logits)


def route_grouped(x: jax.Array, w_router: jax.Array, correction: jax.Array, moe: MoeConfig) -> Routing:
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter), in float32: sigmoid scores s of the logits; the
    choice ranks s + correction (the per-expert bias that DeepSeek's auxiliary-loss-free balancing adjusts; it
    steers the choice, not the weights): each of `moe.groups` equal groups of experts is scored by its best two, the
    best `moe.topk_groups` groups stay, and the top_k experts among them are chosen. Their weights are s (divided by
    their sum with norm_topk_prob) times `moe.routed_scale`. x (..., D), w_router (D, E), correction (E,)."""
    # The weights in float32 too: served ones may be stored in bfloat16.
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), w_router.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)  # (..., E)
    scores = jax.nn.sigmoid(logits)  # (..., E)
    choice = scores + correction.astype(jnp.float32)  # (..., E)
    e, groups = logits.shape[-1], moe.groups
    if groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], groups, e // groups)  # (..., G, E/G)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # (..., G)
        best = jax.lax.top_k(group_scores, moe.topk_groups)[1]  # (..., topk_groups)
        kept = jnp.any(jax.nn.one_hot(best, groups, dtype=jnp.bool_), axis=-2)  # (..., G)
        choice = jnp.where(jnp.repeat(kept, e // groups, axis=-1), choice, -jnp.inf)  # (..., E)
    experts = jax.lax.top_k(choice, moe.top_k)[1]  # (..., k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)  # (..., k)
    if moe.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)  # transformers' epsilon
    return Routing(experts.astype(jnp.int32), weights * moe.routed_scale, logits)


def router_stats(r: Routing, dropped: jax.Array) -> MoeStats:
    """The load-balancing loss, the z-loss and the per-expert load of a routing over all its tokens (the global
    batch under jit, so the figures do not depend on the mesh)."""
    e = r.logits.shape[-1]
    tokens = tuple(range(r.logits.ndim - 1))  # the tokens' axes
    # (E,) f_e, no gradient: the share of the assignments (a mean over the tokens' axes and the k choices).
    load = jnp.mean(jax.nn.one_hot(r.experts, e, dtype=jnp.float32), axis=(*tokens, len(tokens)))
    importance = jnp.mean(jax.nn.softmax(r.logits, axis=-1), axis=tokens)  # (E,) P_e: the gradient flows through this
    aux = e * jnp.sum(load * importance)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(r.logits, axis=-1)))
    return MoeStats(aux, z, load, dropped.astype(jnp.float32))


def metrics(stats: MoeStats, capacity: bool) -> dict[str, jax.Array]:
    """Train metrics of a model's stacked stats (L_moe layers): the losses averaged over the MoE layers, and the
    busiest and idlest expert's load over the mean load (1.0 = balanced) in the worst layer."""
    load = stats.load  # (L, E)
    e = load.shape[-1]
    out = {"moe/aux_loss": jnp.mean(stats.aux_loss), "moe/z_loss": jnp.mean(stats.z_loss),
           "moe/load_max_over_mean": jnp.max(e * jnp.max(load, axis=-1)),
           "moe/load_min_over_mean": jnp.min(e * jnp.min(load, axis=-1))}
    if capacity:
        out["moe/dropped"] = jnp.mean(stats.dropped)
    return out


# THE EXPERTS' MATH ON ONE DEVICE ------------------------------------------------------------------------------


class SwigluClamp(NamedTuple):
    """GPT-OSS's clamped SwiGLU (model.moe.swiglu_alpha, swiglu_limit), static."""

    alpha: float
    limit: float


class Experts(NamedTuple):
    """SwiGLU experts' weights in the compute dtype: the local ones inside shard_map; GPT-OSS's gate and up biases
    and clamp when it has them (the down projection's bias: `down_bias`)."""

    w_gate: jax.Array  # (E, D, M)
    w_up: jax.Array  # (E, D, M)
    w_down: jax.Array  # (E, M, D)
    b_gate: jax.Array | None = None  # (E, M)
    b_up: jax.Array | None = None  # (E, M)
    clamp: SwigluClamp | None = None  # static: not an array, kept out of shard_map's operands

    @property
    def arrays(self) -> tuple[jax.Array, ...]:
        """The weights (and biases, when present) in field order: shard_map's operands."""
        return tuple(a for a in self[:5] if a is not None)

    def with_arrays(self, arrays: tuple[jax.Array, ...]) -> Experts:
        """These experts with `arrays` (as `arrays` gives them: this device's part inside shard_map) in place."""
        return Experts(*arrays, clamp=self.clamp)


def swiglu(gate: jax.Array, up: jax.Array, clamp: SwigluClamp | None) -> jax.Array:
    """silu(gate) * up, or with `clamp` GPT-OSS's gate * sigmoid(alpha * gate) * (up + 1) of the gate clamped above
    at limit and up clamped to [-limit, limit] (transformers' GptOssExperts._apply_gate)."""
    if clamp is None:
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, clamp.limit)
    up = jnp.clip(up, -clamp.limit, clamp.limit)
    return gate * jax.nn.sigmoid(gate * clamp.alpha) * (up + 1)


def down_bias(b_down: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """GPT-OSS's down-projection bias of each token's output: b_down (E, D), experts and weights (..., k) ->
    (..., D) float32, sum_j weights_j * b_down[experts_j] (each expert adds its bias to its weighted output)."""
    return jnp.einsum("...k,...kd->...d", weights, jnp.take(b_down, experts, axis=0).astype(jnp.float32))


def _grouped_swiglu(xs: jax.Array, group_sizes: jax.Array, w: Experts) -> jax.Array:
    """xs (R, D) sorted by expert, group_sizes (E,) -> (R, D); rows past sum(group_sizes) come out zero. On CPU
    the grouped matmul is lm/model/cpu.py's tiled one: XLA:CPU computes ragged_dot as E matmuls over all rows."""
    if cpu.cpu_tweak("grouped"):  # the rows stay in tiles through the three matmuls
        tiles = cpu.tile_layout(group_sizes, xs.shape[0])
        xt = cpu.to_tiles(xs, tiles)  # (tiles, t, D)
        gate, up = cpu.tiled_matmul(xt, w.w_gate, tiles), cpu.tiled_matmul(xt, w.w_up, tiles)  # (tiles, t, M) each
        if w.b_gate is not None:  # each tile is one expert's; padding rows never leave the tiles
            gate, up = gate + w.b_gate[tiles.group][:, None], up + w.b_up[tiles.group][:, None]
        h = swiglu(gate, up, w.clamp)  # (tiles, t, M)
        return cpu.from_tiles(cpu.tiled_matmul(h, w.w_down, tiles), tiles)  # (R, D)
    gate = jax.lax.ragged_dot(xs, w.w_gate, group_sizes)  # (R, M)
    up = jax.lax.ragged_dot(xs, w.w_up, group_sizes)  # (R, M)
    if w.b_gate is not None:
        # Each row's expert; rows past the groups get E, whose bias is zero, so they still come out zero.
        ids = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(xs.shape[0]), side="right")  # (R,)
        gate = gate + jnp.take(w.b_gate, ids, axis=0, mode="fill", fill_value=0)
        up = up + jnp.take(w.b_up, ids, axis=0, mode="fill", fill_value=0)
    return jax.lax.ragged_dot(swiglu(gate, up, w.clamp), w.w_down, group_sizes)  # (R, D)


@jax.custom_vjp
def move_rows(x: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """out[i] = x[src[i]] (zero where src[i] is out of range): x (R, D), src (R_out,) -> (R_out, D), for a map that
    sends each row of x to at most one row of out, given both ways: dst (R,) is where each row of x goes (out of
    range: nowhere), so out[dst[r]] = x[r]. Forward and backward are both gathers (the backward: g[dst]). Written
    as `.at[].set` or as a plain `take`, one of the two passes is a scatter of whole rows, which the TPU compiler
    turns into code that took minutes to compile per MoE layer (docs/planning.md)."""
    return jnp.take(x, src, axis=0, mode="fill", fill_value=0)


def _move_rows_fwd(x, src, dst):
    return move_rows(x, src, dst), (src, dst)


def _move_rows_bwd(res, g):
    src, dst = res
    return jnp.take(g, dst, axis=0, mode="fill", fill_value=0), None, None


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def inverse(perm: jax.Array, size: int) -> jax.Array:
    """perm (R,) distinct indices into [0, size) (out of range: skipped) -> (size,) int32, inv[perm[r]] = r, and
    R (out of range) where no r maps: a scatter of R int32s."""
    return jnp.full((size,), perm.shape[0], jnp.int32).at[perm].set(jnp.arange(perm.shape[0], dtype=jnp.int32),
                                                                     mode="drop")


def _combine(y: jax.Array, weights: jax.Array) -> jax.Array:
    """y (N, k, D) each assignment's expert output, weights (N, k) float32 -> (N, D), summed in float32."""
    out = jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype), preferred_element_type=jnp.float32)
    return out.astype(y.dtype)


def dropless(x: jax.Array, experts: jax.Array, weights: jax.Array, w: Experts) -> jax.Array:
    """x (N, D), experts and weights (N, k) -> (N, D): every assignment computed, sorted by expert and grouped."""
    n, k = experts.shape
    flat = experts.reshape(-1)  # (N*k,)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # (N*k,) assignments grouped by expert
    unsorted = inverse(order, order.shape[0])  # (N*k,) each assignment's place in sorted order
    xs = move_rows(jnp.repeat(x, k, axis=0), order, unsorted)  # (N*k, D)
    group_sizes = jnp.bincount(flat, length=w.w_gate.shape[0]).astype(jnp.int32)  # (E,)
    ys = _grouped_swiglu(xs, group_sizes, w)  # (N*k, D) in sorted order
    y = move_rows(ys, unsorted, order)  # (N*k, D) back in assignment order
    return _combine(y.reshape(n, k, -1), weights)


def capacity(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """Slots per expert and sequence: capacity_factor times an even share of the sequence's assignments."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / experts))


def dispatch_masks(experts: jax.Array, weights: jax.Array, num_experts: int, slots: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """experts, weights (G, S, k) for G sequences of S tokens -> (dispatch (G, S, E, C) 0/1, combine (G, S, E, C)
    float32, kept (G, S, k) bool). Each expert's slots are filled by every token's first choice in token order, then
    the second choices, and so on (GShard, Switch): a token's best expert is the last to drop it."""
    g, s, k = experts.shape
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)  # (G, S, k, E)
    by_choice = onehot.transpose(0, 2, 1, 3).reshape(g, k * s, num_experts)  # (G, k*S, E) first choices first
    queue = jnp.cumsum(by_choice, axis=1) - 1  # (G, k*S, E) place in each expert's queue
    position = jnp.sum(queue * by_choice, axis=-1).reshape(g, k, s).transpose(0, 2, 1)  # (G, S, k)
    kept = position < slots  # (G, S, k)
    expert_hot = onehot.astype(jnp.float32) * kept[..., None].astype(jnp.float32)  # (G, S, k, E)
    slot_hot = jax.nn.one_hot(position, slots, dtype=jnp.float32)  # (G, S, k, C); past C: all zeros
    dispatch = jnp.einsum("gske,gskc->gsec", expert_hot, slot_hot)  # (G, S, E, C)
    combine = jnp.einsum("gske,gskc,gsk->gsec", expert_hot, slot_hot, weights)  # (G, S, E, C)
    return dispatch, combine, kept


def _slots_swiglu(xe: jax.Array, w: Experts) -> jax.Array:
    """xe (G, E, C, D) each expert's slots -> (G, E, C, D): batched dense matmuls, one per expert."""
    gate = jnp.einsum("gecd,edm->gecm", xe, w.w_gate)  # (G, E, C, M)
    up = jnp.einsum("gecd,edm->gecm", xe, w.w_up)  # (G, E, C, M)
    if w.b_gate is not None:  # empty slots gain them too, but their combine weights are zero
        gate, up = gate + w.b_gate[:, None], up + w.b_up[:, None]
    return jnp.einsum("gecm,emd->gecd", swiglu(gate, up, w.clamp), w.w_down)  # (G, E, C, D)


def capacity_dispatch(x: jax.Array, experts: jax.Array, weights: jax.Array, w: Experts, capacity_factor: float,
                      *, expert_axis: str | None = None, mlp_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """x (G, S, D), experts and weights (G, S, k) -> (y (G, S, D), dropped assignments (G, S, k) as 0/1 float32).
    With `expert_axis` (inside shard_map) w holds this device's E/n experts; the slots of all E go out and come
    back with an all-to-all."""
    g, s, k = experts.shape
    n = jax.lax.axis_size(expert_axis) if expert_axis else 1
    num_experts = w.w_gate.shape[0] * n
    dispatch, combine, kept = dispatch_masks(experts, weights, num_experts, capacity(s, k, num_experts, capacity_factor))
    dt = x.dtype
    xe = jnp.einsum("gsd,gsec->gecd", x, dispatch.astype(dt))  # (G, E, C, D)
    if expert_axis:
        # (G, E, C, D) -> (n*G, E/n, C, D): every device's slots of my experts.
        xe = jax.lax.all_to_all(xe, expert_axis, split_axis=1, concat_axis=0, tiled=True)
    ye = _slots_swiglu(xe, w)
    if mlp_axis:
        ye = jax.lax.psum(ye, mlp_axis)  # the expert hidden axis is split over mlp_axis: add the partial sums
    if expert_axis:
        ye = jax.lax.all_to_all(ye, expert_axis, split_axis=0, concat_axis=1, tiled=True)  # (G, E, C, D)
    y = jnp.einsum("gecd,gsec->gsd", ye, combine.astype(dt), preferred_element_type=jnp.float32).astype(dt)
    return y, 1.0 - kept.astype(jnp.float32)


def dropless_expert_parallel(x: jax.Array, experts: jax.Array, weights: jax.Array, w: Experts, expert_axis: str,
                             mlp_axis: str | None) -> jax.Array:
    """`dropless` inside shard_map with this device's E/n experts in w: x (N, D), experts and weights (N, k) ->
    (N, D). Rows travel to their experts' devices and back in fixed slots of S = N * min(k, E/n) rows per device
    pair (a token sends at most min(k, E/n) of its assignments to one device: no slot can overflow)."""
    n_tokens, k = experts.shape
    n = jax.lax.axis_size(expert_axis)
    local = w.w_gate.shape[0]  # E/n experts here
    rows = n_tokens * min(k, local)  # S
    flat = experts.reshape(-1)  # (A,), A = N*k
    order = jnp.argsort(flat, stable=True)  # (A,)
    sorted_experts = flat[order]  # (A,)
    dest = sorted_experts // local  # (A,) the device holding each assignment's expert
    counts = jnp.bincount(dest, length=n)  # (n,)
    slot = jnp.arange(flat.shape[0]) - (jnp.cumsum(counts) - counts)[dest]  # (A,) row within dest's slots
    # Every row moves by `move_rows` (a gather both ways), its maps built by scatters of int32 indices only.
    placed = inverse(order, flat.shape[0])  # (A,) each assignment's place in sorted order
    to_slot = (dest * rows + slot)[placed].astype(jnp.int32)  # (A,) each assignment's row of send
    from_slot = inverse(to_slot, n * rows)  # (n*S,) each row of send's assignment (A: empty)

    # DISPATCH: my rows for device j in send[j]; empty rows carry the expert id `local`, past every group.
    send = move_rows(jnp.repeat(x, k, axis=0), from_slot, to_slot).reshape(n, rows, -1)  # (n, S, D)
    send_ids = jnp.take(flat % local, from_slot, mode="fill", fill_value=local).reshape(n, rows)  # (n, S)
    recv = jax.lax.all_to_all(send, expert_axis, 0, 0).reshape(n * rows, -1)  # (n*S, D) rows from every device
    recv_ids = jax.lax.all_to_all(send_ids, expert_axis, 0, 0).reshape(-1)  # (n*S,)

    # MY EXPERTS: the received rows grouped by local expert, empty rows last (ragged_dot leaves them zero).
    by_expert = jnp.argsort(recv_ids, stable=True).astype(jnp.int32)  # (n*S,)
    received = inverse(by_expert, n * rows)  # (n*S,) each received row's place in expert order
    group_sizes = jnp.bincount(recv_ids, length=local).astype(jnp.int32)  # (E/n,); the id `local` is not counted
    ys = _grouped_swiglu(move_rows(recv, by_expert, received), group_sizes, w)  # (n*S, D)
    if mlp_axis:
        ys = jax.lax.psum(ys, mlp_axis)  # the expert hidden axis is split over mlp_axis: add the partial sums
    back = move_rows(ys, received, by_expert).reshape(n, rows, -1)  # (n, S, D) in the senders' slots

    # COMBINE: the results return to the devices that sent the rows, then to assignment order.
    done = jax.lax.all_to_all(back, expert_axis, 0, 0).reshape(n * rows, -1)  # (n*S, D): device j's in done[j]
    y = move_rows(done, to_slot, from_slot)  # (A, D)
    return _combine(y.reshape(n_tokens, k, -1), weights)


# ON THE MESH --------------------------------------------------------------------------------------------------


def experts_forward(x: jax.Array, r: Routing, w: Experts, capacity_factor: float) -> tuple[jax.Array, jax.Array]:
    """x (B, T, D) and its routing (rows of B*T tokens) -> (the experts' weighted output (B, T, D), the share of
    assignments dropped () float32).

    Under a mesh (`runtime.sharding.activate`) the work runs in shard_map, each device on its own rows: sorting the
    global batch would gather it onto every device. Without a mesh (unit tests), or when the batch does not split
    over the batch axes (decoding a few rows), XLA places the plain computation itself."""
    b, t, d = x.shape
    k = r.experts.shape[-1]
    experts, weights = r.experts.reshape(b, t, k), r.weights.reshape(b, t, k)
    mesh = jax.sharding.get_abstract_mesh()
    rules = spmd.get_logical_axis_rules()
    batch_axes = logical_to_spec(("batch",), rules)[0] if rules and not mesh.empty else None
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
    shards = math.prod(mesh.shape[a] for a in batch_axes) if batch_axes else 1
    if not batch_axes or b % shards:
        return _local(x, experts, weights, w, capacity_factor, None, None)
    expert_axis, mlp_axis = logical_to_spec(("experts", "expert_mlp"), rules)
    assert expert_axis is None or expert_axis in batch_axes, "the expert axis must split the batch too"
    ep = expert_axis if expert_axis and mesh.shape[expert_axis] > 1 else None
    tp = mlp_axis  # psum'd even at size 1: the weights' spec names the axis, so the output varies over it
    # Dropless routing is per token, so a sequence split over context (lm/parallel/context.py) stays split; capacity is per
    # sequence (GShard), so there each device takes its rows whole.
    seq_axes = None if capacity_factor else logical_to_spec(("seq",), rules)[0]
    rows = P(batch_axes, seq_axes)
    token_axes = batch_axes + ((seq_axes,) if isinstance(seq_axes, str) else tuple(seq_axes or ()))
    up, down = P(expert_axis, None, mlp_axis), P(expert_axis, mlp_axis, None)  # gathered over embed's fsdp
    specs = (up, up, down, P(expert_axis, mlp_axis), P(expert_axis, mlp_axis))[: len(w.arrays)]  # + biases

    def local(x, experts, weights, *arrays):
        y, dropped = _local(x, experts, weights, w.with_arrays(arrays), capacity_factor, ep, tp)
        return y, jax.lax.pmean(dropped, token_axes)

    y, dropped = jax.shard_map(local, in_specs=(rows, rows, rows, *specs), out_specs=(rows, P()))(
        x, experts, weights, *w.arrays)
    return y, dropped


def _local(x, experts, weights, w: Experts, capacity_factor: float, expert_axis, mlp_axis):
    """One device's rows: x (b, T, D), experts and weights (b, T, k) -> (y (b, T, D), dropped share ())."""
    b, t, d = x.shape
    if capacity_factor:
        y, dropped = capacity_dispatch(x, experts, weights, w, capacity_factor, expert_axis=expert_axis,
                                       mlp_axis=mlp_axis)
        return y, jnp.mean(dropped)
    def flat(a):  # (b, T, ...) -> (b*T, ...)
        return a.reshape(b * t, *a.shape[2:])

    if expert_axis:
        y = dropless_expert_parallel(flat(x), flat(experts), flat(weights), w, expert_axis, mlp_axis)
    else:
        y = dropless(flat(x), flat(experts), flat(weights), w)
        if mlp_axis:
            y = jax.lax.psum(y, mlp_axis)
    return y.reshape(b, t, d), jnp.zeros((), jnp.float32)
