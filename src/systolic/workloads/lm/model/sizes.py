"""An lm's parameter count and training memory from its config alone, checked before the model is traced.

`nnx.eval_shape` of the model traces every layer, so a config with d_model = 10^7 or 10^5 layers would spend
minutes tracing (and compiling) before the allocation fails. The count here is arithmetic on the config; the
bytes are a lower bound: float32 parameters, and for the trained ones a float32 gradient and the optimizer's
moments in `optim.moment_dtype` (AdamW keeps two; Muon one for the hidden matrices, counted for all as a lower
bound), plus what the backward pass keeps of one micro-batch (`activation_floats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from systolic.runtime import memory
from systolic.workloads.lm.config import LMConfig, LMOptimConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model import remat
from systolic.workloads.lm.model.flops import attention_params, lora_params

PARAM_BYTES = 4  # parameters stay float32 whatever model.dtype computes in
GRAD_BYTES = 4  # a float32 gradient per trained parameter
# What to change when a train step does not fit: this bound's refusal, the compiled step's (engine/fit.py), a plan's.
MEMORY_FIX = ("set model.remat=full (recompute activations in the backward pass), lower train.batch_size to the largest "
              "that fits (`systolic plan lm --target <slice> --search` finds it; or raise train.grad_accum), use more "
              "chips (a larger mesh.fsdp), keep the optimizer's moments in bfloat16 (optim.moment_dtype=bfloat16), "
              "or shrink the model (model.d_model, model.layers, model.mlp_dim, model.moe.experts, model.lora.rank).")


def param_count(cfg: ModelConfig, vocab: int) -> int:
    """All parameters (norms and biases left out: a lower bound), adapters included."""
    d = cfg.d_model
    attention = attention_params(cfg)
    dense_mlp = (3 if cfg.family == "llama" else 2) * d * cfg.d_mlp
    moe = cfg.moe
    moe_mlp = d * moe.experts + 3 * d * cfg.d_expert * (moe.experts + moe.shared_experts)
    moe_layers = len(cfg.moe_layers)
    blocks = cfg.layers * attention + (cfg.layers - moe_layers) * dense_mlp + moe_layers * moe_mlp
    embeddings = vocab * d * (1 if cfg.tie_embeddings else 2)
    positions = cfg.max_seq_len * d if cfg.family == "gpt2" else 0
    return blocks + embeddings + positions + lora_params(cfg)


def training_bytes(cfg: LMConfig, vocab: int) -> int:
    """A lower bound on the memory a train step of `cfg` needs, over all devices."""
    total = param_count(cfg.model, vocab)
    trained = lora_params(cfg.model) if cfg.model.lora.rank else total
    micro_batch = cfg.train.batch_size // cfg.train.grad_accum
    tokens = micro_batch * cfg.data.seq_len
    per_trained = GRAD_BYTES + moment_bytes(cfg.optim)
    return PARAM_BYTES * total + per_trained * trained + tokens * 4 * activation_floats(cfg.model)


def moment_bytes(cfg: LMOptimConfig) -> int:
    """The optimizer's bytes per trained parameter, at least: AdamW's two moments, or Muon's one (the hidden
    matrices' momentum; AdamW's two for the rest are left out), each in `moment_dtype`."""
    return (2 if cfg.name == "adamw" else 1) * jnp.dtype(cfg.moment_dtype).itemsize


def activation_floats(m: ModelConfig) -> int:
    """float32 values per token of the micro-batch that the backward pass keeps, at least: each layer's input, and
    with `model.remat` none or dots also each layer's MLP hidden state and its LoRA adapters' rank-wide products (x A,
    which B's gradient needs), all layers at once; with the policies that recompute the MLP (except_mlp, attn,
    context, full: lm/model/remat.py), one layer's, plus what each layer keeps of its attention. A LoRA rank of 10^6 on
    a small model is refused here rather than by the allocator after minutes of compiling."""
    lora = m.lora.rank * len(m.lora.target_names(m.family)) if m.lora.rank else 0
    inner = min(m.d_mlp, m.d_expert * m.moe.top_k) if m.moe.experts else m.d_mlp  # dense layers may mix in
    per_layer = inner + lora
    if m.remat in ("none", "dots"):
        return m.layers * (m.d_model + per_layer)
    widths = {remat.QKV: (m.heads + 2 * m.n_kv_heads) * m.d_head, remat.CONTEXT: m.heads * m.d_head,
              remat.ATTN_OUT: m.d_model}  # values per token of each named activation
    kept = sum(widths[name] for name in remat.KEEPS[m.remat])
    return m.layers * (m.d_model + kept) + per_layer
def check_training_fits(cfg: LMConfig, vocab: int, devices: Sequence[Any]) -> None:
    """A UserError, before any tracing, when the model cannot be trained in the memory of `devices`."""
    m = cfg.model
    params = param_count(m, vocab)
    memory.check_fits(
        training_bytes(cfg, vocab), devices,
        what=(f"Training this lm ({params:,} parameters: model.d_model={m.d_model}, model.layers={m.layers}, "
              f"vocabulary {vocab:,}{f', model.moe.experts={m.moe.experts}' if m.moe.experts else ''}; float32 "
              f"parameters and gradients, {cfg.optim.moment_dtype} optimizer moments, and a micro-batch's activations "
              "kept for the backward pass)"),
        fix=MEMORY_FIX,
    )
