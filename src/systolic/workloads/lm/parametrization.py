"""What each lm parameter is to the optimizer: its role, and how Muon reads it as a matrix.

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
"""

from __future__ import annotations

from typing import Any, Literal

import jax

from systolic.engine.muon import Dims

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
