"""The lm model builds itself: its structure without weights, its parameters' layout on a mesh, fresh parameters,
and which of them train. What training, serving, Hugging Face conversion and post-training all start from; the
training module adds the optimizer and the loss, never the model."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.runtime.sharding import Rules, activate, check_divisible
from systolic.workloads.lm.model import lora
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.transformer import Transformer


def model_graphdef(mcfg: ModelConfig, vocab: int) -> nnx.GraphDef:
    """The model's structure without weights (no allocation): what `nnx.merge` needs inside jitted code."""
    abstract = nnx.eval_shape(lambda: Transformer(mcfg, vocab, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract, nnx.Param)
    return graphdef


def param_shardings(mcfg: ModelConfig, vocab: int, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings of the parameters (pure dict), from the logical names the layers declare. Raises a
    ConfigError naming the parameter when a sharded dimension does not divide over its mesh axes."""
    with activate(mesh, rules):
        abstract = nnx.eval_shape(lambda: Transformer(mcfg, vocab, rngs=nnx.Rngs(0)))
        params = nnx.state(abstract, nnx.Param)
        specs = nnx.to_pure_dict(nnx.get_partition_spec(params))
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    flat_specs = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]}
    flat_shapes = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]}
    check_divisible({f"params{k}": v for k, v in flat_shapes.items()}, {f"params{k}": v for k, v in flat_specs.items()}, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=is_spec)


def init_params(mcfg: ModelConfig, vocab: int, key: jax.Array) -> dict[str, Any]:
    """Freshly initialised parameters (pure dict), adapters included."""
    return nnx.to_pure_dict(nnx.state(Transformer(mcfg, vocab, rngs=nnx.Rngs(params=key)), nnx.Param))


def trainable_split(mcfg: ModelConfig, tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trained, frozen) parts of a parameters' pure dict (or of a tree of its shardings): with model.lora the
    adapters and the base weights, otherwise everything and nothing."""
    return lora.split(tree) if mcfg.lora.rank else (tree, {})
