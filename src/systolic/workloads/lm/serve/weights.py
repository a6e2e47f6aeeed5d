"""The weights as served: stored in the model's compute dtype.

Training keeps float32 parameters and casts each to the compute dtype where it is used (`w.astype(self.dtype)` in
lm/model/transformer.py). A decode step is bound by how fast the weights stream from memory, so serving them as
float32 streams twice the bytes of bfloat16 only to round them the same way in every step. Cast once when the
engine takes them: the same values reach every matmul, so the outputs do not change.

The parameters a layer uses in float32 stay float32 (a few KiB each): the norms' scales and biases (the norms
multiply in float32, lm/model/layers.py), attention sinks (added to float32 scores) and a mixture of experts'
router (routing is decided in float32, lm/model/moe.py).

Weights already quantized (Qwix arrays of int8 or fp8) keep their values; their scales (one per output channel) are
stored in the compute dtype too, as Qwix makes them when it quantizes bfloat16 weights: with float32 scales the TPU
compiler copies every layer's int8 weight slices into on-chip memory before their dots (tests/plan/test_serve.py
checks), and a bfloat16 scale is within int8's own rounding. The measurements: docs/design-notes.md, this module's
section.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import qwix

from systolic.workloads.lm.model import quant

# A parameter whose path names one of these is used in float32 by its layer (see above), never cast.
FLOAT32_PARAMS = ("norm", "sinks", "router", "score_correction")


def serving_params(params: Any, dtype: jnp.dtype) -> Any:
    """params (a pure dict of arrays; some may be `qwix.QArray`s) with every float32 weight a layer casts to
    `dtype` before use, and every quantized weight's float32 scales, stored in `dtype` (on its device, with its
    sharding); the rest unchanged. A no-op for a float32 model."""
    if jnp.dtype(dtype) == jnp.float32:
        return params

    def cast(path, leaf):
        if isinstance(leaf, qwix.QArray):  # its values as they are; float32 scales in dtype (see above)
            return dataclasses.replace(leaf, scale=leaf.scale.astype(dtype)) if leaf.scale.dtype == jnp.float32 \
                else leaf
        if leaf.dtype != jnp.float32:
            return leaf
        if any(word in str(getattr(key, "key", "")) for key in path for word in FLOAT32_PARAMS):
            return leaf
        return leaf.astype(dtype)  # on its devices, laid out as the float32 array was

    return jax.tree_util.tree_map_with_path(cast, params, is_leaf=lambda x: isinstance(x, qwix.QArray))


def served_checkpoint(params: Any, scheme: str | None, dtype: jnp.dtype, *, stacked: bool) -> Any:
    """A float32 checkpoint's parameters as the engine serves them with `--quantize scheme` (None: not quantized): the
    projections quantized from float32 (quant.quantize_params; `stacked`: model.scan_layers), then `serving_params`.
    What `systolic plan lm --serve` and benchmarks/studies/serve_engine.py lower and draw, abstract."""
    if scheme is not None:
        params = quant.quantize_params(params, scheme, stacked=stacked)
    return serving_params(params, dtype)
