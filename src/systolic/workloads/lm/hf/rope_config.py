"""RoPE settings between config.json and model.rope_scaling, both ways: transformers' `rope_scaling` /
`rope_parameters` (default, linear, llama3, yarn, longrope) on import, and what an export writes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from systolic.workloads.lm.hf.config_rules import unsupported
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.sections import RopeScalingConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")  # rope_type values that import (to model.rope_scaling.type)


def rope_from_hf(hf: dict[str, Any], src: Path, rope: dict[str, Any], *, partial: bool = False
          ) -> tuple[float, RopeScalingConfig]:
    """(rope_theta, scaling) of the RoPE parameters `rope` as transformers 5 standardises them: `rope_scaling` (4.x)
    over `rope_parameters`, the theta inside the dict over the top-level `rope_theta`. `partial`: the architecture
    rotates part of each head (Phi-3: the caller reads partial_rotary_factor), which the others refuse."""
    if any(isinstance(v, dict) for v in rope.values()):
        raise unsupported(src, "per-layer-type rope_parameters", rope, "one set of RoPE parameters for every layer")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    if kind in ("su", "yarn") and hf.get("model_type") == "phi3":
        kind = "longrope"  # what transformers' Phi3Config makes of Phi-3's "su" (and "yarn") scaling
    fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if fraction not in (None, 1, 1.0) and not partial:
        raise unsupported(src, "partial_rotary_factor", fraction, "1.0 (RoPE over the whole head; partial RoPE "
                           "converts for Phi3ForCausalLM)")
    if kind not in ROPE_TYPES:
        raise unsupported(src, "rope_type", kind, f"one of {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, RopeScalingConfig()
    if kind == "linear":
        return theta, RopeScalingConfig(type="linear", factor=float(rope["factor"]))
    # transformers prefers a top-level original_max_position_embeddings (Phi-3 style), then the dict's, then the
    # model's own context.
    original = int(hf["original_max_position_embeddings"] if "original_max_position_embeddings" in hf else
                   rope.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    if kind == "llama3":
        return theta, RopeScalingConfig(type="llama3", factor=float(rope["factor"]), original_max_seq_len=original,
                                        low_freq_factor=float(rope["low_freq_factor"]),
                                        high_freq_factor=float(rope["high_freq_factor"]))
    if kind == "longrope":
        return theta, longrope_from_hf(hf, src, rope, original)
    factor = float(rope.get("factor") or hf["max_position_embeddings"] / original)
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return theta, RopeScalingConfig(
        type="yarn", factor=factor, original_max_seq_len=original, beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1), attention_factor=float(attention_factor or 0.0),
        truncate=bool(rope.get("truncate", True)),
    )


def longrope_from_hf(hf: dict[str, Any], src: Path, rope: dict[str, Any], original: int) -> RopeScalingConfig:
    """LongRoPE's scaling (Phi-3): the short and long factors; factor defaults to max_position_embeddings over the
    original context, as transformers derives it for the default attention_factor."""
    factors = [rope.get("short_factor"), rope.get("long_factor")]
    if not all(isinstance(f, list) and f and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                 and math.isfinite(x) and x > 0 for x in f) for f in factors):
        raise unsupported(src, "rope_parameters short_factor / long_factor", factors,
                           "two lists of positive numbers, one per rotated pair of dimensions")
    return RopeScalingConfig(
        type="longrope", factor=float(rope.get("factor") or hf["max_position_embeddings"] / original),
        original_max_seq_len=original, attention_factor=float(rope.get("attention_factor") or 0.0),
        short_factor=tuple(float(x) for x in factors[0]), long_factor=tuple(float(x) for x in factors[1]))


def yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """`rope_parameters` without rope_theta, as transformers 5 reads it."""
    s = cfg.rope_scaling
    if s.type == "none":
        return {"rope_type": "default"}
    if s.type == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.type == "llama3":
        return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_seq_len}
    if s.type == "longrope":
        out = {"rope_type": "longrope", "factor": s.factor, "original_max_position_embeddings": s.original_max_seq_len,
               "short_factor": list(s.short_factor), "long_factor": list(s.long_factor)}
        return {**out, "attention_factor": s.attention_factor} if s.attention_factor else out
    out = {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_seq_len,
           "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate}
    return {**out, "attention_factor": s.attention_factor} if s.attention_factor else out
