"""What each lm parameter is to the optimizer (its role, how Muon reads it as a matrix), and muP's multipliers.

Roles, as the muP papers (Yang et al., Tensor Programs V) sort weights by which of their dimensions grow with the
model's width: `hidden` (the blocks' projections, width x width; the only weights Muon moves), `input` (embeddings),
`output` (the unembedding, lm_head) and `vector` (everything else: norm scales, biases, LoRA's adapters).

Our attention weights are 3-D; Muon orthogonalises each as one matrix of its fan-in axes by its fan-out axes
(`MUON_AXES`), one matrix per projection as modded-nanogpt does, not one per head. Axes count from the end, so
scan_layers' leading `layers` axis is a batch of separate matrices, one per layer.

muP (`model.parametrization=mup`) scales init, learning rates, output logits and attention logits by the width
multiplier m = d_model / `model.mup_base_width`, so that the model at the base width is the standard one and a
learning rate tuned there transfers (Tensor Programs V, Table 3, and the `mup` package's MuReadout/MuAdam). With
Muon the hidden weights' steps need no width factor: the spectral scale sqrt(fan_out / fan_in) (optim/muon.py
`shape_scale`) already moves every layer's output by O(lr) at any width. Each role's members and each multiplier:
docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax

from systolic.optim.muon import Dims
from systolic.errors import UserError
from systolic.workloads.lm.model.config import ModelConfig

Role = Literal["hidden", "input", "output", "vector"]

# Hidden weights: (fan-in axes, fan-out axes), counted from the end.
MUON_AXES = {
    "wq": ((-3,), (-2, -1)), "wk": ((-3,), (-2, -1)), "wv": ((-3,), (-2, -1)), "wo": ((-3, -2), (-1,)),
    "w_gate": ((-2,), (-1,)), "w_up": ((-2,), (-1,)), "w_down": ((-2,), (-1,)),
    "w_fc": ((-2,), (-1,)), "w_proj": ((-2,), (-1,)),
}
INPUTS = ("embed", "pos_embed")
OUTPUTS = ("lm_head",)


def role(path: tuple[Any, ...]) -> Role:
    """The role of the parameter at `path` (a key path into the parameters' pure dict)."""
    names = [str(getattr(k, "key", k)) for k in path]
    if any(n.endswith("_lora") for n in names):
        return "vector"
    if names[-1] in MUON_AXES:
        return "hidden"
    if names[-1] in INPUTS:
        return "input"
    return "output" if names[-1] in OUTPUTS else "vector"


def roles(tree: Any) -> Any:
    """The role of every leaf of a parameters' pure dict (or of a tree of the same shape)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: role(path), tree)


def muon_dims(tree: Any) -> Any:
    """Muon's `Dims` for each hidden weight of `tree`, None for the others (placeholders of the parameters that
    `optax.partition` masked out stay as they are: they have no leaves to map)."""

    def dims(path, _):
        if role(path) != "hidden":
            return None
        return Dims(*MUON_AXES[str(getattr(path[-1], "key", path[-1]))])

    return jax.tree_util.tree_map_with_path(dims, tree)


# muP -----------------------------------------------------------------------------------------------------------


def hidden_init_scale(cfg: ModelConfig) -> float:
    """The factor on the hidden weights' init std: 1 / sqrt(m), variance 1/fan_in relative to the base."""
    return 1 / math.sqrt(cfg.width_mult)


def output_multiplier(cfg: ModelConfig) -> float:
    """The factor on the logits: 1 / m (MuReadout)."""
    return 1 / cfg.width_mult


def attention_correction(cfg: ModelConfig) -> float:
    """The factor on the queries that turns the attention implementations' 1 / sqrt(d_head) into muP's
    sqrt(d_head / m) / d_head: 1 / sqrt(m)."""
    return 1 / math.sqrt(cfg.width_mult)


def adam_lr_multiplier(path: tuple[Any, ...], cfg: ModelConfig) -> float:
    """The factor on AdamW's learning rate for the parameter at `path`: 1 / m for hidden weights, else 1."""
    return 1 / cfg.width_mult if role(path) == "hidden" else 1.0


def to_standard(cfg: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters with which the standard-parametrization model computes what the muP model `cfg` computes
    with `params` (LoRA merged): the readout multiplier folded into lm_head, the attention correction into the
    queries (wq and bq, or with qk_norm the query norm's scale, as the norm would undo a factor before it and RoPE
    is linear). What `systolic convert to-hf` writes, Hugging Face models having neither multiplier. UserError
    with tied embeddings: the table is also the input embedding, so the readout multiplier cannot be folded."""
    if cfg.parametrization == "standard":
        return params
    if cfg.tie_embeddings:
        raise UserError(
            f"This run uses model.parametrization=mup with model.tie_embeddings=true: its logits are the tied "
            f"embedding's times muP's readout multiplier 1/{cfg.width_mult:g}, which a Hugging Face model cannot "
            "express, and folding it into the table would also scale the input embeddings. Expected untied "
            "embeddings for a muP model that leaves systolic. Fix: train with model.tie_embeddings=false, or use "
            "`systolic export` (jax.export), which keeps the multiplier."
        )
    query = ("q_norm", "scale") if cfg.qk_norm else None

    def fold(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        if names[-1] == "lm_head":
            return x * output_multiplier(cfg)
        if "attn" in names and (tuple(names[-2:]) == query if query else names[-1] in ("wq", "bq")):
            return x * attention_correction(cfg)
        return x

    return jax.tree_util.tree_map_with_path(fold, params)
