"""DeepSeek-V3's `config.json` (transformers' DeepseekV3Config, model_type deepseek_v3; also Kimi K2's
architecture) <-> the lm workload's `ModelConfig`: the llama block with multi-head latent attention (`model.mla`,
lm/model/mla.py) and, from layer first_k_dense_replace on, a mixture of experts with DeepSeek's router
(`model.moe.scoring=sigmoid`: a correction bias on the choice, group-limited top-k, routed_scaling_factor) and
shared experts.

YaRN's mscale_all_dim also scales the attention logits (transformers' `yarn_apply_mscale`): by mscale^2 with
mscale = 0.1 * mscale_all_dim * ln(factor) + 1, which the import folds into `model.attn_logit_scale` and the export
writes back as mscale_all_dim. Multi-token-prediction modules (num_nextn_predict_layers, stored as layers after
the decoder's) serve speculative decoding only and are not imported; the export has none. DeepSeek balances its
experts by adjusting the correction bias, not by a loss: the import turns our load-balancing and z-losses off.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from systolic.errors import UserError
from systolic.workloads.lm.hf.config_rules import require, unsupported
from systolic.workloads.lm.hf.rope_config import rope_from_hf, rope_to_hf
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.sections import MlaConfig, MoeConfig

MODEL_TYPE = "deepseek_v3"


def model_config(hf: dict[str, Any], src: Path, common: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig for a DeepSeek-V3 config.json (`hf_config.model_config` checked the value types, DeepSeek's
    sizes among them)."""
    require(hf, src, {"hidden_act": "silu", "attention_bias": False, "scoring_func": "sigmoid",
                                 "topk_method": "noaux_tc"})
    d, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    if hf.get("num_key_value_heads") not in (None, heads):
        # transformers expands the latent into every query head and would then repeat those heads again.
        raise unsupported(src, "num_key_value_heads", hf["num_key_value_heads"],
                                     f"num_attention_heads ({heads}): MLA's keys and values have one head per query")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta, scaling = rope_from_hf(hf, src, rope)
    mla = MlaConfig(kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                    qk_nope_head_dim=int(hf["qk_nope_head_dim"]), qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                    v_head_dim=int(hf["v_head_dim"]), rope_interleave=bool(hf.get("rope_interleave", True)))
    if not mla.kv_lora_rank:
        raise unsupported(src, "kv_lora_rank", hf["kv_lora_rank"], "a latent of at least 1 value")
    mscale_all_dim = rope.get("mscale_all_dim")
    logit_scale = 0.0
    if scaling.type != "none" and mscale_all_dim:  # transformers' yarn_apply_mscale
        mscale = 0.1 * float(mscale_all_dim) * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
        logit_scale = mla.qk_head_dim**-0.5 * mscale * mscale
    return ModelConfig(
        **common, family="llama", d_model=d, layers=layers, heads=heads, mlp_dim=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"], rope_theta=theta, rope_scaling=scaling,
        norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)), mla=mla,
        attn_logit_scale=logit_scale, moe=_moe(hf, src, layers))


def _moe(hf: dict[str, Any], src: Path, layers: int) -> MoeConfig:
    first = int(hf.get("first_k_dense_replace") or 0)
    if first >= layers:  # every layer dense
        return MoeConfig()
    shared = int(hf.get("n_shared_experts") or 0)
    if shared < 1:
        raise unsupported(src, "n_shared_experts", hf.get("n_shared_experts"),
                                     "at least 1 (transformers' DeepSeek-V3 always has a shared expert MLP)")
    return MoeConfig(experts=int(hf["n_routed_experts"]), top_k=int(hf["num_experts_per_tok"]),
                     mlp_dim=int(hf["moe_intermediate_size"]), shared_experts=shared,
                     norm_topk_prob=bool(hf.get("norm_topk_prob", True)), first=first,
                     aux_loss_weight=0.0, z_loss_weight=0.0, scoring="sigmoid", groups=int(hf.get("n_group") or 1),
                     topk_groups=int(hf.get("topk_group") or 1),
                     routed_scale=float(hf.get("routed_scaling_factor", 1.0)))


def check(cfg: ModelConfig) -> None:
    """A UserError unless transformers' DeepSeek-V3 computes this run (MLA, and DeepSeek's kind of experts)."""
    moe, problems = cfg.moe, []
    if not cfg.mla.kv_lora_rank:
        problems.append("model.moe.scoring=sigmoid without multi-head latent attention (model.mla.kv_lora_rank=0)")
    if moe.experts and (moe.scoring != "sigmoid" or moe.every != 1 or moe.shared_experts < 1 or moe.shared_gate
                        or moe.capacity_factor):
        problems.append(f"experts with scoring={moe.scoring}, every={moe.every}, shared_experts={moe.shared_experts}, "
                        f"shared_gate={moe.shared_gate}, capacity_factor={moe.capacity_factor} (DeepSeek-V3: sigmoid, "
                        "1, at least 1, false, 0)")
    if cfg.layer_types or cfg.embed_multiplier != 1 or cfg.mlp_activation != "silu" or cfg.norm_placement != "pre" \
            or cfg.final_logit_softcap:
        problems.append("Gemma's switches or per-layer kinds")
    if cfg.attn_logit_scale and (cfg.rope_scaling.type == "none" or cfg.rope_scaling.factor <= 1):
        problems.append(f"model.attn_logit_scale={cfg.attn_logit_scale} without RoPE scaling by a factor over 1 "
                        "(DeepSeek scales the logits only through YaRN's mscale_all_dim)")
    if problems:
        raise UserError(
            f"This run matches no Hugging Face architecture: {'; '.join(problems)}. DeepSeek-V3 has multi-head latent "
            "attention and, after its dense first layers, experts with a sigmoid router and shared experts. Fix: only "
            "runs that one Hugging Face architecture computes can be exported."
        )


def config_json(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of a DeepSeek-V3 that computes `cfg` (`check` passed)."""
    mla, moe = cfg.mla, cfg.moe
    rope = {**rope_to_hf(cfg), "rope_theta": cfg.rope_theta}
    if cfg.attn_logit_scale:  # back to the mscale_all_dim whose mscale^2 / sqrt(qk_head_dim) it is
        mscale = math.sqrt(cfg.attn_logit_scale * math.sqrt(mla.qk_head_dim))
        # Without `mscale` beside it, transformers derives no cos/sin factor from it (ours is attention_factor).
        rope["mscale_all_dim"] = (mscale - 1.0) / (0.1 * math.log(cfg.rope_scaling.factor))
    out = {**common, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.layers,
           "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.heads, "hidden_act": "silu",
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
           "attention_bias": False, "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank or None,
           "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
           "v_head_dim": mla.v_head_dim, "rope_interleave": mla.rope_interleave, "num_nextn_predict_layers": 0}
    if not moe.experts:  # dense: no layer reaches first_k_dense_replace
        return {**out, "first_k_dense_replace": cfg.layers, "n_routed_experts": 1, "num_experts_per_tok": 1,
                "n_group": 1, "topk_group": 1}
    return {**out, "n_routed_experts": moe.experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": cfg.d_expert, "n_shared_experts": moe.shared_experts,
            "first_k_dense_replace": moe.first, "norm_topk_prob": moe.norm_topk_prob, "n_group": moe.groups,
            "topk_group": moe.topk_groups, "routed_scaling_factor": moe.routed_scale}
