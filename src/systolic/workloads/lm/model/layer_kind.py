"""What sets one layer of the stack apart from the others: whether it attends within `model.sliding_window` (the
sliding layers of `model.layer_types`) and whether it rotates q and k (false on `model.no_rope_layers`, SmolLM3's
NoPE layers). A kind is Python bools when the layers that run together agree on it, so the kernels see a constant
window and no rotation is traced for a NoPE layer; in a scan over stacked layers that differ, the fields that differ
are arrays scanned beside the weights (one entry per layer) and the rest stay Python bools."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from systolic.workloads.lm.model.config import ModelConfig


class LayerKind(NamedTuple):
    sliding: bool | jax.Array  # attends within model.sliding_window
    rope: bool | jax.Array  # rotates q and k by position


def layer_kinds(cfg: ModelConfig) -> tuple[LayerKind, ...]:
    """Each layer's kind, in Python bools."""
    return tuple(LayerKind(s, r) for s, r in zip(cfg.local_layers, cfg.rope_layers, strict=True))


def stacked_kinds(cfg: ModelConfig) -> tuple[LayerKind, LayerKind | None]:
    """For a scan over every layer: (the kind the layers share, each field the first layer's where they differ;
    the fields that differ as (L,) bool arrays, None in the fields they share), or (the kind, None) when every
    layer is alike."""
    kinds = layer_kinds(cfg)
    if len(set(kinds)) == 1:
        return kinds[0], None
    fields = zip(*kinds, strict=True)  # per field: (L,) Python bools
    # None is an empty pytree: a scan slices the arrays and passes the Nones through.
    return kinds[0], LayerKind(*(None if len(set(f)) == 1 else jnp.asarray(f) for f in fields))


def with_traced(shared: LayerKind, traced: LayerKind | None) -> LayerKind:
    """One layer's kind inside a scan: `traced`'s fields (this layer's entry) where they are set, else `shared`'s."""
    if traced is None:
        return shared
    return LayerKind(*(s if t is None else t for s, t in zip(shared, traced, strict=True)))

