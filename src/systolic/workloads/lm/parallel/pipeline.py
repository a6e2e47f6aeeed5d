"""Pipeline parallelism: the stacked layers split over the `stage` mesh axis, microbatches passed stage to stage.

The design is MaxText's (layers/pipeline.py), written small: one `shard_map` that is manual over `stage` (and `data`,
see `run`; fsdp, expert and tensor stay automatic, so the blocks inside shard as they do without a pipeline), a loop
of ticks, and at each tick every stage runs its layers on the activation it holds and passes the result to the next
stage with one `ppermute` round the ring of stages. The embedding, final norm, head and loss split the batch over
`stage` as over a data axis, so they run once per example.

Schedules: with S stages, M microbatches and r repeats, r = 1 is GPipe and r > 1 the circular (interleaved)
schedule, whose bubble is S - 1 ticks of r M + S - 1 instead of S - 1 of M + S - 1 (`bubble_fraction`). The weights
are stored in layer order, so checkpoints and exports need no permutation; the circular schedule pays for that with
weight traffic between stages once per step. Training and validation run the pipeline; generation, `systolic eval`
and a model called without `pipeline` scan over all layers instead. Where each layer runs, where activations wait,
and the costs: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "stage"
_GROUP_WEIGHTS = "pipeline_group_weights"  # checkpoint name of a tick's slice of the stage's weights


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a pipelined step in which stages idle: (S - 1) / (r M + S - 1); 0 without a pipeline."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def describe(stages: int, microbatches: int, repeats: int) -> str:
    """One line for `systolic plan` and `bench`: the schedule and its bubble."""
    schedule = "GPipe" if repeats == 1 else f"circular, {repeats} repeats"
    bubble = bubble_fraction(stages, microbatches, repeats)
    return (f"pipeline: {stages} stages x {microbatches} microbatches ({schedule}): bubble "
            f"(S-1)/(rM+S-1) = {bubble:.1%} of the step idle")


def split_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
    """(B, ...) -> (M, B/M, ...) such that each device keeps its own rows (as engine/step.py's grad_accum split):
    reshaping to (B/M, M) keeps axis 0 split over the data axes, and moving M to the front is then local."""
    x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])  # (B/M, M, ...)
    return jnp.moveaxis(x, 1, 0)  # (M, B/M, ...)


def join_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`: (M, B/M, ...) -> (B, ...)."""
    x = jnp.moveaxis(x, 0, 1)  # (B/M, M, ...)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def run(layer_fn: Callable[[Any, jax.Array, Any], jax.Array], weights: Any, x: jax.Array, rows: Any, *,
        microbatches: int, repeats: int, mesh: Any) -> jax.Array:
    """Runs the stacked layers over the pipeline: `layer_fn(one_layer_weights, x, rows) -> x` for each layer in order.

    Args:
      weights: a pytree of stacked layer weights, each (L, ...) in layer order, its layer axis split over `stage`.
      x: the first layer's input (B, T, D).
      rows: a pytree of per-example inputs of the layers (rotary tables, segment ids), each with leading axis B.
    Returns:
      The last layer's output (B, T, D).
    """
    stages, m_count, r = mesh.shape[AXIS], microbatches, repeats
    ticks = r * m_count + stages - 1

    # (L, ...) -> (r, L/r, ...): with L/r split over the stages, stage s holds the groups s, S + s, ... (layer order).
    grouped = jax.tree.map(lambda w: w.reshape(r, w.shape[0] // r, *w.shape[1:]), weights)
    xs = split_microbatches(x, m_count)  # (M, B/M, T, D)
    # Only stage 0 reads the inputs: handing the others zeros (a stage axis split over `stage`, so each device makes
    # its own block) keeps the backward pass from summing the inputs' gradient over the stages, an all-reduce of the
    # whole batch's activations (and, in bfloat16, one that XLA:CPU's AllReducePromotion pass crashes on).
    xs = jnp.zeros((stages, *xs.shape), xs.dtype).at[0].set(xs)  # (S, M, B/M, T, D)
    rows = jax.tree.map(lambda a: split_microbatches(a, m_count), rows)  # (M, B/M, ...) each

    def stage_program(w, xs, rows):
        """One stage's ticks. w: its groups (r, L/(r S), ...); xs (1, M, B/M, T, D), rows: every microbatch's."""
        s = jax.lax.axis_index(AXIS)
        xs = xs[0]  # (M, B/M, T, D): the inputs on stage 0, zeros elsewhere
        ring = [(i, (i + 1) % stages) for i in range(stages)]

        def run_group(w, inp, t):
            item = t - s  # this stage's work item: microbatch item mod M in repeat item div M
            k = jnp.clip(item // m_count, 0, r - 1)
            row = jax.tree.map(lambda a: a[jnp.mod(item, m_count)], rows)  # (B/M, ...)
            group = jax.tree.map(lambda a: jax.ad_checkpoint.checkpoint_name(a[k], _GROUP_WEIGHTS), w)

            def layer(h, layer_w):
                return layer_fn(layer_w, h, row), None

            return jax.lax.scan(layer, inp, group)[0]  # (B/M, T, D)

        # The slice of weights a tick uses is recomputed in the backward pass, not saved once per tick (r M + S - 1
        # copies of the stage's weights); everything else is saved as the layers themselves decide (model.remat).
        run_group = jax.checkpoint(run_group, policy=jax.checkpoint_policies.save_anything_except_these_names(
            _GROUP_WEIGHTS))

        def receive(buf, incoming, t):
            """Stage 0 puts the last stage's output of work item t - S (sent at tick t - 1) in its microbatch's slot."""
            done = t - stages
            slot = jnp.mod(done, m_count)
            keep = (s == 0) & (done >= 0) & (done < r * m_count)
            return buf.at[slot].set(jnp.where(keep, incoming, buf[slot]))

        def tick(carry, t):
            buf, incoming = carry  # (M, B/M, T, D), (B/M, T, D)
            buf = receive(buf, incoming, t)
            inp = jnp.where(s == 0, buf[jnp.mod(t, m_count)], incoming)  # stage 0 reads the buffer, others the ring
            out = run_group(w, inp, t)
            # The sync point of the pipeline: every stage hands its output to the next (the last to stage 0).
            return (buf, jax.lax.ppermute(out, AXIS, ring)), None

        (buf, incoming), _ = jax.lax.scan(tick, (xs, jnp.zeros_like(xs[0])), jnp.arange(ticks))
        return receive(buf, incoming, ticks)[None]  # (1, M, B/M, T, D): stage 0's holds the outputs

    # Manual over `stage` and, when it is split, `data`: a tick's weight gradients are then this device's partial
    # sums, added up over `data` once after the loop (the shard_map's transpose), where with `data` automatic XLA
    # all-reduces them inside the loop, once per tick. The other axes (fsdp, expert, tensor) stay automatic, so
    # the layers shard as they do without a pipeline; the batch's fsdp and expert split lies within data's blocks.
    data = "data" if mesh.shape["data"] > 1 else None
    manual = frozenset({AXIS} | ({data} if data else set()))
    weights_spec = P(None, AXIS)  # the grouped weights' L/r axis over the stages
    out = jax.shard_map(stage_program, mesh=mesh, in_specs=(weights_spec, P(AXIS, None, data), P(None, data)),
                        out_specs=P(AXIS, None, data), axis_names=manual, check_vma=False)(grouped, xs, rows)
    # out: (S, M, B/M, T, D)
    return join_microbatches(out[0])  # (B, T, D)
