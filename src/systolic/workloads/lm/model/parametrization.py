"""What each lm parameter is to the optimizer (its role, how Muon reads it as a matrix), and muP's multipliers.

Roles, as the muP papers (Yang et al., Tensor Programs V) sort weights by which of their dimensions grow with the
model's width:
- `hidden`: the blocks' projections, both dimensions growing (width x width): attention's wq, wk, wv, wo, the MLP's
  w_gate, w_up, w_down (llama) or w_fc, w_proj (gpt2). The only weights Muon moves.
- `input`: embeddings (vocab or positions x width): embed, pos_embed.
- `output`: the unembedding (width x vocab): lm_head.
- `vector`: everything else: norm scales, biases, and LoRA's adapters (one dimension is the rank, which does not
  grow; muP treats such weights as vectors).

Our attention weights are 3-D; Muon orthogonalises each as one matrix of its fan-in axes by its fan-out axes
(`MUON_AXES`): wq, wk, wv (D, H, hd) as (D, H*hd), wo (H, hd, D) as (H*hd, D), one matrix per projection as
modded-nanogpt does, not one per head. Axes count from the end, so scan_layers' leading `layers` axis is a batch of
separate matrices, one per layer.

muP (`model.parametrization=mup`), relative to a base width B (`model.mup_base_width`) with the width multiplier
m = d_model / B, so that the model at d_model = B is the standard one and a learning rate tuned there transfers.
Tensor Programs V, Table 3 (muP for Adam), and the `mup` package's MuReadout/MuAdam, in our terms:
- hidden weights: init variance proportional to 1/fan_in (our std / sqrt(m); wo's and w_down's depth factor
  1/sqrt(2 layers) kept), AdamW learning rate lr / m;
- input weights (embeddings) and all biases and norms: init and learning rate unchanged;
- output layer: logits multiplied by 1/m (MuReadout's 1 / width_mult; tied embeddings too), its init and
  learning rate unchanged;
- attention logits scaled by 1/d_head instead of 1/sqrt(d_head), times sqrt(d_head at the base width), so the
  scale is the standard one at the base. The base's head size is taken as d_head / m: width grows at a fixed
  number of heads, each head wider (as in the papers' sweeps and ours).
With Muon the hidden weights' steps need no width factor: Muon's step scaled by sqrt(fan_out / fan_in) (the
spectral condition, optim/muon.py `shape_scale`) already moves every layer's output by O(lr) at any width;
under muP Muon uses that factor instead of Keller Jordan's sqrt(max(1, fan_out / fan_in)).
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
