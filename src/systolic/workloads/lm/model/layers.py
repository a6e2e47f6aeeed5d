"""The pieces every attention and MLP of the lm model builds on: the compute dtype, float32 parameters with logical
axis names, and the norm (lm/model/transformer.py's blocks and lm/model/mla.py's latent attention share them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.runtime.platform import compile_platform
from systolic.workloads.lm.model.config import ModelConfig


def resolve_dtype(name: str) -> jnp.dtype:
    """Compute dtype for `ModelConfig.dtype`; 'auto' is bfloat16 on accelerators, float32 on CPU (of the platform
    being compiled for: `systolic plan` traces TPU programs on a CPU host)."""
    if name == "auto":
        return jnp.dtype(jnp.bfloat16 if compile_platform() in ("gpu", "tpu") else jnp.float32)
    return jnp.dtype(name)


def param(key: jax.Array, shape: tuple[int, ...], names: tuple[str | None, ...], std: float | None) -> nnx.Param:
    """A float32 parameter with logical axis names; std=None means ones (norm scales), 0 means zeros (biases)."""
    if std is None:
        init = nnx.initializers.ones
    elif std == 0:
        init = nnx.initializers.zeros
    else:
        init = nnx.initializers.normal(std)
    return param_from(init, key, shape, names)


def param_from(init, key: jax.Array, shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
    """A float32 parameter drawn by `init(key, shape, dtype)`, with logical axis names."""
    # Eager sharding needs a mesh; without one (unit tests, single CPU) keep only the names as metadata.
    eager = not jax.sharding.get_abstract_mesh().empty
    return nnx.Param(nnx.with_partitioning(init, names)(key, shape, jnp.float32), eager_sharding=eager)


class Norm(nnx.Module):
    """RMSNorm (llama) or LayerNorm with bias (gpt2) over the last axis of size `size` (d_model by default; the
    head size for qk_norm, a scale shared by all heads), computed in float32. With `heads` > 0 an RMSNorm over the
    last two axes (heads, size), one scale per entry (OLMo 2's q/k norm over all heads at once)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, size: int = 0, names: tuple[str | None, ...] = (None,),
                 heads: int = 0):
        self.eps = cfg.norm_eps
        shape = (heads, size) if heads else (size or cfg.d_model,)
        self.scale = param(rngs.params(), shape, names, None)
        self.bias = param(rngs.params(), shape, names, 0) if cfg.family == "gpt2" else None

    def __call__(self, x: jax.Array) -> jax.Array:
        # Squares of bf16 activations lose too much precision: normalise in float32.
        h = x.astype(jnp.float32)
        if self.bias is None:
            axes = tuple(range(-self.scale.ndim, 0))  # (-1,), or (-2, -1) over all heads
            h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=axes, keepdims=True) + self.eps)
            return (h * self.scale[...]).astype(x.dtype)
        h = h - jnp.mean(h, axis=-1, keepdims=True)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (h * self.scale[...] + self.bias[...]).astype(x.dtype)
