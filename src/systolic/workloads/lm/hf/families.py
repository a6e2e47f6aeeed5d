"""config.json <-> model switches of Phi-3/Phi-4, OLMo 2, SmolLM3 and Granite: the Llama block with fused projections
and LongRoPE or partial RoPE (Phi-3), post-norms and q/k norms over all heads (OLMo 2), layers without RoPE (SmolLM3),
and embedding, residual, attention and logit multipliers (Granite). lm/hf/config.py dispatches here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from systolic.errors import UserError
from systolic.workloads.lm.hf.config_rules import SUPPORTED_LIST, unsupported
from systolic.workloads.lm.model.config import ModelConfig


# model_type -> architecture (lm/hf/architectures.py's ARCHITECTURES takes these in).
ARCHITECTURES = {"phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "granite": "GraniteForCausalLM"}
FAMILY_TYPES = tuple(ARCHITECTURES)


def switches(hf: dict[str, Any], src: Path, model_type: str) -> dict[str, Any]:
    """The switches of Phi-3 (partial RoPE; its fused tensors are lm/hf/tensors.py's), OLMo 2 (norms after the
    sublayers, q/k norms over all heads), SmolLM3 (NoPE layers) and Granite (the four multipliers); none for the
    other llama-family architectures."""
    if model_type == "phi3":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        return {"partial_rotary_factor": float(1.0 if partial is None else partial)}
    if model_type == "olmo2":
        return {"norm_placement": "post", "qk_norm_scope": "all"}
    if model_type == "smollm3":
        layers = hf["num_hidden_layers"]
        flags = hf.get("no_rope_layers")  # per layer: 1 rotates, 0 is a NoPE layer (transformers' naming)
        if flags is None:
            interval = int(hf.get("no_rope_layer_interval", 4))
            flags = [int((i + 1) % interval != 0) for i in range(layers)] if interval > 0 else None
        if not isinstance(flags, list) or len(flags) != layers or set(flags) - {0, 1}:
            raise unsupported(src, "no_rope_layers", hf.get("no_rope_layers"),
                               f"a list of {layers} entries, 1 (RoPE) or 0 (no RoPE), or a positive interval")
        return {"no_rope_layers": tuple(i for i, flag in enumerate(flags) if not flag)}
    if model_type == "granite":
        d_head = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        attention = float(hf.get("attention_multiplier", 1.0))
        return {"embed_multiplier": float(hf.get("embedding_multiplier", 1.0)),
                "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
                # Granite's attention_multiplier replaces 1/sqrt(head size); that one is our default (0)
                "attn_logit_scale": 0.0 if attention == d_head**-0.5 else attention,
                "logit_divisor": float(hf.get("logits_scaling", 1.0))}
    return {}


def architecture(cfg: ModelConfig) -> str:
    """phi3, olmo2, smollm3 or granite when `cfg` has their switches (one of them computes it), "" when it has
    none of them; a UserError naming what fits none."""
    switches = {  # the llama block's switches that are on, by the name the error shows
        "model.qkv_bias": cfg.qkv_bias, "model.qk_norm": cfg.qk_norm, "model.moe": cfg.moe.experts,
        "model.sliding_window": cfg.sliding_window, "model.layer_types": len(set(cfg.local_layers)) > 1,
        "model.norm_placement=post": cfg.norm_placement == "post",
        "model.norm_placement=sandwich": cfg.norm_placement == "sandwich",
        "model.qk_norm_scope": cfg.qk_norm_scope != "head",
        "model.rope_scaling.type=longrope": cfg.rope_scaling.type == "longrope",
        "model.partial_rotary_factor": cfg.partial_rotary_factor != 1, "model.no_rope_layers": cfg.no_rope_layers,
        "model.embed_multiplier": cfg.embed_multiplier != 1, "model.attn_logit_scale": cfg.attn_logit_scale,
        "model.residual_multiplier": cfg.residual_multiplier != 1, "model.logit_divisor": cfg.logit_divisor != 1,
        "model.attn_logit_softcap": cfg.attn_logit_softcap, "model.final_logit_softcap": cfg.final_logit_softcap,
        "model.rope_local_theta": cfg.rope_local_theta, "model.mlp_activation": cfg.mlp_activation != "silu"}
    on = {k for k, v in switches.items() if v}
    families = {  # model_type: (the switches that pick it, the others it computes too)
        "olmo2": ({"model.norm_placement=post", "model.qk_norm_scope"}, {"model.qk_norm"}),
        "phi3": ({"model.rope_scaling.type=longrope", "model.partial_rotary_factor"}, {"model.sliding_window"}),
        "smollm3": ({"model.no_rope_layers"}, {"model.sliding_window", "model.layer_types"}),
        "granite": ({"model.residual_multiplier", "model.logit_divisor", "model.embed_multiplier",
                     "model.attn_logit_scale"}, set()),
    }
    model_type = next((t for t, (picks, _) in families.items() if on & picks), "")
    if not model_type or (model_type == "granite" and on & {"model.mlp_activation", "model.norm_placement=sandwich"}):
        return ""  # Gemma's scaled embeddings and logits are Gemma's (_gemma_architecture)
    picks, also = families[model_type]
    extra = sorted(on - picks - also)
    problems = [f"{', '.join(extra)} on" if extra else ""]
    if model_type == "olmo2" and not (cfg.norm_placement == "post" and cfg.qk_norm_scope == "all"):
        problems.append("OLMo 2 has both norm_placement=post and q/k norms with qk_norm_scope=all")
    if model_type == "phi3" and cfg.d_head * cfg.heads != cfg.d_model:
        problems.append(f"a head size {cfg.d_head} other than d_model / heads (Phi-3 derives it)")
    if model_type == "smollm3" and cfg.sliding_window and not all(cfg.local_layers):
        sliding_rope = [i for i, (s, r) in enumerate(zip(cfg.local_layers, cfg.rope_layers)) if s and r]
        if sliding_rope:
            problems.append(f"sliding RoPE layers {sliding_rope} (SmolLM3 slides only on NoPE layers)")
    problems = [p for p in problems if p]
    if problems:
        raise UserError(
            f"This run has the switches of {ARCHITECTURES[model_type]} ({', '.join(sorted(on & picks))}) but "
            f"matches no Hugging Face architecture: {'; '.join(problems)}. {ARCHITECTURES[model_type]} computes "
            f"{', '.join(sorted(picks | also))} and nothing else of the llama block's switches. Fix: only runs that "
            f"one Hugging Face architecture computes can be exported ({SUPPORTED_LIST} lists them)."
        )
    return model_type


def config_json(cfg: ModelConfig, model_type: str, out: dict[str, Any]) -> dict[str, Any]:
    """config.json of a Phi-3, OLMo 2, SmolLM3 or Granite from the Llama one `out` (`architecture` checked
    that the architecture computes `cfg`)."""
    out = {**out, "attention_bias": False}
    if model_type == "phi3":
        out.pop("rope_scaling", None)  # transformers' Phi3Config would read it over rope_parameters
        rope = {**out["rope_parameters"], "partial_rotary_factor": cfg.partial_rotary_factor}
        original = cfg.rope_scaling.original_max_seq_len if cfg.rope_scaling.type == "longrope" else cfg.max_seq_len
        return {**out, "rope_parameters": rope, "partial_rotary_factor": cfg.partial_rotary_factor,
                "original_max_position_embeddings": original, "sliding_window": cfg.sliding_window or None,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}
    if model_type == "olmo2":
        return out
    out["mlp_bias"] = False
    if model_type == "smollm3":
        window = cfg.sliding_window or None
        return {**out, "no_rope_layers": [int(rope) for rope in cfg.rope_layers], "use_sliding_window": bool(window),
                "sliding_window": window,
                "layer_types": ["sliding_attention" if local and window else "full_attention"
                                for local in cfg.local_layers]}
    return {**out, "embedding_multiplier": cfg.embed_multiplier, "residual_multiplier": cfg.residual_multiplier,
            "attention_multiplier": cfg.attn_logit_scale or cfg.d_head**-0.5, "logits_scaling": cfg.logit_divisor}
