"""Model FLOPs of a decoder-only transformer, counted once per matmul (the MFU numerator).

Per token of training, with N the number of matmul weights (attention projections, MLP, LM head; not the
embedding lookup, norms or biases):
    6 * N                         forward (2N) + backward (4N)
  + 6 * layers * T * heads * hd   attention scores (QK^T) and mix (AV), causal: half of the T x T pairs
                                  (MLA: (qk_head_dim + v_head_dim) / 2 for hd; a sliding layer's window W < T
                                  makes an average query's T/2 keys W - W^2 / (2T))
With model.moe, N counts a MoE layer's active weights (the router, its top_k experts and the shared experts); with
model.lora the frozen weights count 4 * N (no weight gradients) and the adapters 6 * N_lora. Rematerialisation,
a capacity dispatch's empty slots and XLA:CPU's ragged_dot over every expert are hardware work, not model work,
and are not counted. Each term derived: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

from systolic.workloads.lm.model.config import ModelConfig


def attention_params(cfg: ModelConfig) -> int:
    """One layer's attention projections: q, k, v and o, or multi-head latent attention's q (or q_a and q_b),
    kv_a, kv_b and o (lm/model/mla.py; training expands the latent through kv_b)."""
    d, h, mla = cfg.d_model, cfg.heads, cfg.mla
    if mla.kv_lora_rank:
        q = d * mla.q_lora_rank + mla.q_lora_rank * h * mla.qk_head_dim if mla.q_lora_rank else d * h * mla.qk_head_dim
        kv = d * mla.cache_width + mla.kv_lora_rank * h * (mla.qk_nope_head_dim + mla.v_head_dim)
        return q + kv + h * mla.v_head_dim * d
    hd = cfg.d_head
    return d * h * hd + 2 * d * cfg.n_kv_heads * hd + h * hd * d


def attention_width(cfg: ModelConfig) -> int:
    """Per head, the size of a score's dot product plus that of the value mix: 2 x head size, MLA's
    qk_head_dim + v_head_dim."""
    return cfg.mla.qk_head_dim + cfg.mla.v_head_dim if cfg.mla.kv_lora_rank else 2 * cfg.d_head


def matmul_params(cfg: ModelConfig, vocab: int) -> int:
    """Matmul weights a token is multiplied by (active ones only in MoE layers)."""
    d = cfg.d_model
    attention = attention_params(cfg)
    mlp = (3 if cfg.family == "llama" else 2) * d * cfg.d_mlp
    moe_layers = len(cfg.moe_layers)
    return cfg.layers * attention + (cfg.layers - moe_layers) * mlp + moe_layers * moe_active_params(cfg) + d * vocab


def moe_active_params(cfg: ModelConfig) -> int:
    """One MoE layer's matmul weights per token: router, top_k SwiGLU experts, shared experts and their gate."""
    moe, d = cfg.moe, cfg.d_model
    shared = 3 * d * moe.shared_experts * cfg.d_expert + (d if moe.shared_gate else 0)
    return d * moe.experts + moe.top_k * 3 * d * cfg.d_expert + shared


def lora_params(cfg: ModelConfig) -> int:
    """The adapters' parameters: rank * (fan_in + fan_out) for each targeted projection of each layer."""
    d, m, q, kv = cfg.d_model, cfg.d_mlp, cfg.heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    sizes = {"q": d + q, "k": d + kv, "v": d + kv, "o": q + d, "gate": d + m, "up": d + m, "down": m + d}
    return cfg.layers * cfg.lora.rank * sum(sizes[t] for t in cfg.lora.target_names(cfg.family)) if cfg.lora.rank else 0


def train_flops_per_token(cfg: ModelConfig, vocab: int, seq_len: int) -> float:
    window = cfg.sliding_window
    full_keys = seq_len / 2  # per query, on average
    window_keys = window - window**2 / (2 * seq_len) if 0 < window < seq_len else full_keys
    keys = sum(window_keys if local else full_keys for local in cfg.local_layers)  # over the layers
    attention = 6 * keys * cfg.heads * attention_width(cfg)
    if cfg.lora.rank:
        return 4 * matmul_params(cfg, vocab) + 6 * lora_params(cfg) + attention
    return 6 * matmul_params(cfg, vocab) + attention
