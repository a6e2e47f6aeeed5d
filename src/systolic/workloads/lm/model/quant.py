"""Quantized projections through Qwix (the `qwix` package): weights stored in int8 or fp8 for serving, and
quantization-aware training.

Two independent settings meet in a projection x @ W: the weight's storage, float32 parameters or a Qwix `QArray`
(int8 or float8_e4m3fn values, one scale per output channel, and per layer when the layers are stacked) that
`quantize_params` makes once, for serving; and `model.quant`, the matmul's operands. "none" multiplies in the
compute dtype (a stored int8 weight is dequantized into it, which XLA fuses into the dot); "int8" / "fp8" quantize
the activations too (each row its own absmax scale), so both operands of the dot are int8 (accumulated in int32) or
fp8, through Qwix's `dot_general` for a stored weight or `dot_general_qt` for a float one (training: the backward
pass passes the gradient straight through to the float32 master weights, as MaxText's `int8` recipe does).

What is quantized: the attention and MLP projections (`QUANTIZED`), and the untied LM head (weight-only: the
logits feed a softmax over the whole vocabulary). The embedding lookup, norms, MoE routers and experts, LoRA
adapters and the attention scores stay in float. The two settings in full: docs/design-notes.md, this module's
section.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import qwix
from jax import lax
# Qwix's quantization-aware dot itself: its public API reaches it only by intercepting jax.lax.dot_general in a
# whole model (QtProvider), which our flattened projections do not need (pyproject pins qwix below 0.2).
from qwix._src.core.dot_general_qt import DotGeneralQtConfig, dot_general_qt

from systolic.errors import ConfigError
from systolic.workloads.lm.model import cpu

# The quantized operands' types by setting name (model.quant, and a stored weight's type).
QTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# Serving's `--quantize` schemes: (the stored weights' type, model.quant for the activations).
SCHEMES: dict[str, tuple[str, Literal["none", "int8", "fp8"]]] = {
    "int8": ("int8", "none"),  # weight-only: int8 weights, dequantized into the compute dtype
    "w8a8": ("int8", "int8"),  # int8 weights and int8 activations: an int8 x int8 dot
    "fp8": ("fp8", "fp8"),  # float8_e4m3fn weights and activations
}
# The checkpoint metadata's key that names the scheme of weights stored quantized (`systolic quantize`).
META_KEY = "quantized"
# Each quantized weight by name -> how many of its leading axes a projection contracts (the rest are output
# channels, each with its own scale).
QUANTIZED = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1, "w_fc": 1, "w_proj": 1,
             "lm_head": 1}


def is_quantized(w: Any) -> bool:
    return isinstance(w, qwix.QArray)


def project(x: jax.Array, w: jax.Array | qwix.QArray, contract: int = 1, quant: str = "none") -> jax.Array:
    """x (*lead, *k) @ w (*k, *out) -> (*lead, *out) in x's dtype, contracting the last `contract` axes of x with
    the first `contract` axes of w; `quant` is model.quant (the module docstring says what each case computes)."""
    if not is_quantized(w) and quant == "none":
        return cpu.project(x, w, contract)
    # Contract the axes where they are (no flattening): a reshape of a QArray must keep its scales' blocks whole.
    dims = ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ()))
    rows = tuple(range(x.ndim - contract))  # each activation row (token) has its own scale
    # Qwix multiplies its int32 products by float scales: standard promotion, whatever the caller's setting (for the
    # forward pass; a backward pass that jax traces later runs under the caller's: the tests set standard for QAT).
    with jax.numpy_dtype_promotion("standard"):
        if not is_quantized(w):  # quantization-aware training: quantized forward, straight-through backward
            qt = DotGeneralQtConfig(lhs_qtype=QTYPES[quant], rhs_qtype=QTYPES[quant])
            return dot_general_qt(x, w, dims, qt).astype(x.dtype)
        if quant == "none":
            return _weight_only(x, w, dims, contract, x.dtype)
        dtype = x.dtype
        x = qwix.quantize(x, QTYPES[quant], channelwise_axes=rows)
        return qwix.dot_general(x, w, dims).astype(dtype)


def _weight_only(x: jax.Array, w: qwix.QArray, dims, contract: int, dtype) -> jax.Array:
    """x @ w for a weight stored quantized with one scale per output channel: the integer values converted to x's
    dtype (exactly: |q| <= 127 fits bfloat16's mantissa) meet x in the dot, and the scales multiply the product's
    columns. Dequantizing the weight first (q * scale, what Qwix's dot_general does for a float x) made the TPU
    compiler compute a float32 product per weight element inside the dot's operand fusion: the Llama-3-8B shape
    decoded one request at 51 ms a token on a v5e, where its 8 GB of int8 weights stream in 10 ms. This form, on the
    same chip later (2026-12-07, bfloat16 scales, 1,024-token steps, its int8 pool through the kernel): 77.7 ms, so
    the gain is not shown; not profiled (docs/performance.md, "What is left")."""
    y = lax.dot_general(x, w.qvalue.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    scale = w.scale.reshape(w.scale.shape[contract:])  # (*out): the contracted axes' scales are size 1
    return (y * scale.astype(jnp.float32)).astype(dtype)  # scales served in bfloat16 (serve/weights.py) too


def readout(x: jax.Array, w: jax.Array | qwix.QArray) -> jax.Array:
    """The LM head: x (B, T, D) @ w (D, V) -> logits float32 (B, T, V), float32 accumulation (a stored
    quantized head is dequantized: weight-only)."""
    if is_quantized(w):
        return _weight_only(x, w, (((2,), (0,)), ((), ())), 1, jnp.float32)
    return jnp.einsum("btd,dv->btv", x, w, preferred_element_type=jnp.float32)


def quantize_params(params: dict, scheme: str, *, stacked: bool) -> dict:
    """The model's parameters (a pure dict of float arrays) with every weight in QUANTIZED stored as a QArray of
    `scheme`'s type (SCHEMES), scaled per output channel (absmax); everything else unchanged. `stacked`: the
    blocks' parameters carry a leading layers axis (model.scan_layers), which keeps a scale per layer.
    Deterministic: the same parameters give the same bytes."""
    if scheme not in SCHEMES:
        raise ConfigError(
            f"Unknown quantization scheme {scheme!r}. Expected one of {', '.join(SCHEMES)}: int8 (int8 weights), "
            "w8a8 (int8 weights and activations), fp8 (float8_e4m3fn weights and activations). Fix: pass one of them."
        )
    qtype = QTYPES[SCHEMES[scheme][0]]

    def walk(tree: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = walk(value, (*path, str(key)))
            elif key in QUANTIZED and "router" not in tree:  # MoE experts (beside their router) stay float
                lead = 1 if stacked and path[:1] == ("blocks",) else 0
                contracted = range(lead, lead + QUANTIZED[key])
                channels = [a for a in range(value.ndim) if a not in contracted]
                out[key] = qwix.quantize(value, qtype, channelwise_axes=channels)
            else:
                out[key] = value
        return out

    return walk(params, ())


def quantized_shardings(shardings: Any, qparams: Any) -> Any:
    """The float parameters' shardings (the same tree as the parameters) fitted to `quantize_params`' tree: a
    QArray's values keep their weight's sharding, its scales drop the mesh axes of the contracted (size-1) axes."""

    def fit(sharding: jax.sharding.Sharding, value: Any) -> Any:
        if not is_quantized(value):
            return sharding
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return qwix.QArray(sharding, sharding, None, value.qtype)
        spec = tuple(sharding.spec) + (None,) * (value.scale.ndim - len(sharding.spec))
        scale_spec = jax.sharding.PartitionSpec(*(None if n == 1 else s for n, s in zip(value.scale.shape, spec)))
        return qwix.QArray(sharding, jax.sharding.NamedSharding(sharding.mesh, scale_spec), None, value.qtype)

    return jax.tree.map(fit, shardings, qparams)


def param_bytes(params: Any) -> int:
    """Bytes the parameters take (a QArray: its values and its scales)."""
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(params))
