"""LoRA (Hu et al. 2021, as Hugging Face PEFT does it): low-rank adapters on frozen projections.

A targeted projection W, of shape (*in, *out) in our layout (wq: (D, H, hd), wo: (H, hd, D)), gains an adapter
beside it (`model.Adapter`), `<weight>_lora` with A (*in, r) and B (r, *out), and computes
y = x W + alpha / r * (x A) B. B starts at zero, so a fresh adapter leaves the model unchanged; A starts as PEFT's
`kaiming_uniform_(a=sqrt(5))`, uniform in +-1/sqrt(fan_in). A and B carry W's logical axis names on their W-sides
and `lora_rank` (replicated) between, so they are split over the mesh as W is.

In the parameters' pure dict the adapters are the subtrees under keys ending in `_lora`: `split` separates them
(trained) from the base (frozen), `combine` puts them back, and `merge` folds them into the base weights,
W' = W + alpha / r * A B, for export: the merged model computes what the adapted one does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.sections import LORA_TARGETS, LoraConfig

SUFFIX = "_lora"  # an adapter of the weight `wq` is `wq_lora`, beside it


def targeted_weights(cfg: ModelConfig) -> tuple[str, ...]:
    """Our names of the weights that model.lora adapts, e.g. ("wq", "wv")."""
    if not cfg.lora.rank:
        return ()
    return tuple(LORA_TARGETS[cfg.family][t][1] for t in cfg.lora.target_names(cfg.family))


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The model without adapters: what `merge` returns parameters for."""
    return dataclasses.replace(cfg, lora=LoraConfig())


# THE PARAMETERS' PURE DICT ------------------------------------------------------------------------------------


def split(tree: dict[Any, Any]) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """(adapters, base) of a parameters' pure dict, or of any tree of the same nested dicts (shardings, shapes):
    the subtrees under keys ending in `_lora`, and the rest."""
    adapters: dict[Any, Any] = {}
    base: dict[Any, Any] = {}
    for key, value in tree.items():
        if isinstance(key, str) and key.endswith(SUFFIX):
            adapters[key] = value
        elif isinstance(value, dict):
            a, base[key] = split(value)
            if a:
                adapters[key] = a
        else:
            base[key] = value
    return adapters, base


def combine(adapters: dict[Any, Any], base: dict[Any, Any]) -> dict[Any, Any]:
    """The inverse of `split`: the base's dicts with the adapters put back beside their weights."""
    if not adapters:
        return base
    out = dict(base)
    for key, value in adapters.items():
        out[key] = combine(value, base[key]) if key in base else value
    return out


def merge(cfg: ModelConfig, adapters: dict[Any, Any], base: dict[Any, Any]) -> dict[Any, Any]:
    """The base parameters with every adapter folded in: W' = W + alpha / r * A B (jit it, as it maps each weight)."""
    scale = cfg.lora.scale

    def fold(a_tree: dict[Any, Any], b_tree: dict[Any, Any]) -> dict[Any, Any]:
        out = dict(b_tree)
        for key, value in a_tree.items():
            if isinstance(key, str) and key.endswith(SUFFIX):
                w = out[key[: -len(SUFFIX)]]
                out[key[: -len(SUFFIX)]] = w + scale * low_rank_product(value["a"], value["b"], w.shape)
            else:
                out[key] = fold(value, b_tree[key])
        return out

    return fold(adapters, base)


def low_rank_product(a: jax.Array, b: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A B shaped like the weight: a (*lead, *in, r), b (*lead, r, *out) -> (*lead, *in, *out), where `lead` is the
    stacked `layers` axis of scan_layers (or nothing), in float32 at full precision."""
    lead = a.ndim + b.ndim - len(shape) - 2
    fan_in, r = math.prod(a.shape[lead:-1]), a.shape[-1]
    a2 = a.reshape(*a.shape[:lead], fan_in, r)  # (*lead, in, r)
    b2 = b.reshape(*b.shape[:lead], r, -1)  # (*lead, r, out)
    return jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST).reshape(shape)  # (*lead, *in, *out)
