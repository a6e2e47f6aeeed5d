"""An lm's parameter count and the activations its backward pass keeps, from its model config alone.

`nnx.eval_shape` of the model traces every layer, so a config with d_model = 10^7 or 10^5 layers would spend
minutes tracing (and compiling) before the allocation fails. These counts are arithmetic on the config, what
a training run's memory bound (lm/preflight.py) and a loaded run's check are made of.
"""

from __future__ import annotations

from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model import remat
from systolic.workloads.lm.model.flops import attention_params, lora_params


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


def activation_floats(m: ModelConfig) -> int:
    """float32 values per token of the micro-batch that the backward pass keeps, at least: each layer's input, and
    with `model.remat` none or dots also each layer's MLP hidden state and its LoRA adapters' rank-wide products (x A,
    which B's gradient needs), all layers at once; with the policies that recompute the MLP (except_mlp, attn,
    context, full: lm/model/remat.py), one layer's, plus what each layer keeps of its attention. A LoRA rank of 10^6 on
    a small model is refused here rather than by the allocator after minutes of compiling."""
    lora = m.lora.rank * len(m.lora.target_names(m.family)) if m.lora.rank else 0
    inner = min(m.d_mlp, m.d_expert * m.moe.top_k) if m.moe.experts else m.d_mlp  # dense layers may mix in
    per_layer = inner + lora
    if m.remat not in remat.KEEPS:  # none, dots: every layer keeps its MLP's hidden state
        return m.layers * (m.d_model + per_layer)
    widths = {remat.QKV: (m.heads + 2 * m.n_kv_heads) * m.d_head, remat.CONTEXT: m.heads * m.d_head,
              remat.ATTN_OUT: m.d_model}  # values per token of each named activation
    kept = sum(widths[name] for name in remat.KEEPS[m.remat])
    return m.layers * (m.d_model + kept) + per_layer
