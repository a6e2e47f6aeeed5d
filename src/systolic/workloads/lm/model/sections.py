"""The lm model config's sub-sections: RoPE scaling, LoRA adapters, mixture-of-experts MLPs and DeepSeek-V3's
multi-head latent attention (the fields of ModelConfig, config.py, that are sections of their own). What the layers
and the Hugging Face conversion read of them."""

from __future__ import annotations

import dataclasses
from typing import Literal

from systolic.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
    """RoPE frequencies stretched for contexts longer than pre-training's, as Hugging Face's `rope_parameters`
    compute them (`lm/model/rope.py`): `linear` divides every frequency by `factor`; `llama3` (Llama 3.1+) divides the
    low frequencies by `factor`, keeps the high ones and blends in between; `yarn` blends per frequency between
    the two by `beta_fast`/`beta_slow` and scales cos and sin by `attention_factor`; `longrope` (Phi-3, Phi-4-mini)
    divides each frequency by its own `short_factor` entry while a sequence stays within original_max_seq_len and by
    its `long_factor` entry once it runs past it, and scales cos and sin by `attention_factor`."""

    type: Literal["none", "linear", "llama3", "yarn", "longrope"] = "none"
    factor: float = 1.0
    original_max_seq_len: int = 0  # llama3 and yarn: the pre-training context (HF original_max_position_embeddings)
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_seq_len / low_freq_factor are divided
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_seq_len / high_freq_factor are kept
    beta_fast: float = 32.0  # yarn: rotations within original_max_seq_len above which a frequency is kept
    beta_slow: float = 1.0  # yarn: ... below which it is divided by factor
    attention_factor: float = 0.0  # yarn: cos/sin scale; 0 = YaRN's 0.1 * ln(factor) + 1
    truncate: bool = True  # yarn: round the blended band of dimensions outwards to whole dimensions
    # longrope: one divisor per rotated pair of dimensions, for sequences within original_max_seq_len and beyond it;
    # attention_factor 0 = LongRoPE's sqrt(1 + ln(factor) / ln(original_max_seq_len))
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def validate(self) -> None:
        positive = {"factor": self.factor, "low_freq_factor": self.low_freq_factor, "beta_fast": self.beta_fast,
                    "beta_slow": self.beta_slow}
        bad = [f"model.rope_scaling.{k}={v}" for k, v in positive.items() if not v > 0]
        if self.attention_factor < 0:
            bad.append(f"model.rope_scaling.attention_factor={self.attention_factor}")
        if self.original_max_seq_len < 0:
            bad.append(f"model.rope_scaling.original_max_seq_len={self.original_max_seq_len}")
        if bad:
            raise ConfigError(
                f"{', '.join(bad)} out of range: factor, low_freq_factor, beta_fast and beta_slow must be greater "
                "than 0, attention_factor (0: YaRN's default) and original_max_seq_len at least 0. Fix: take the values from "
                "the model's Hugging Face rope_parameters, or keep the defaults."
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must be greater than low_freq_factor="
                f"{self.low_freq_factor}: llama3 scaling blends the frequencies between the two bands, dividing by "
                "their difference. Fix: e.g. model.rope_scaling.low_freq_factor=1 model.rope_scaling.high_freq_factor=4."
            )
        if self.type != "longrope" and (self.short_factor or self.long_factor):
            raise ConfigError(
                f"model.rope_scaling.short_factor and long_factor are set with model.rope_scaling.type={self.type}: "
                "only longrope reads them. Fix: model.rope_scaling.type=longrope, or leave both empty."
            )
        if self.type == "longrope" and not (self.short_factor and len(self.short_factor) == len(self.long_factor)
                                            and all(f > 0 for f in self.short_factor + self.long_factor)):
            raise ConfigError(
                f"model.rope_scaling.type=longrope needs short_factor and long_factor, one positive divisor per "
                f"rotated pair of dimensions each, but got {len(self.short_factor)} and {len(self.long_factor)} "
                "entries. Fix: copy both lists from the model's Hugging Face rope_parameters (Phi-3's rope_scaling)."
            )
        if self.type == "longrope" and self.original_max_seq_len == 1:
            raise ConfigError(
                "model.rope_scaling.type=longrope with model.rope_scaling.original_max_seq_len=1: LongRoPE's attention "
                "factor sqrt(1 + ln(factor) / ln(original_max_seq_len)) divides by ln(1) = 0, and a model pre-trained "
                "on one position has no context to extend. Expected the context it was pre-trained with (Hugging "
                "Face's original_max_position_embeddings, e.g. 4096). Fix: e.g. "
                "model.rope_scaling.original_max_seq_len=4096."
            )
        if self.type in ("llama3", "yarn", "longrope") and self.original_max_seq_len <= 0:
            raise ConfigError(
                f"model.rope_scaling.type={self.type} needs model.rope_scaling.original_max_seq_len, the context the "
                "model was pre-trained with (Hugging Face's original_max_position_embeddings), but it is 0. Fix: e.g. "
                "model.rope_scaling.original_max_seq_len=8192."
            )


# LoRA target names -> the projection each adapts, per family (model.py builds the adapters; lora.py merges them).
# GPT-2's c_fc/c_proj play the roles of Llama's up/down projections; it has no gate.
LORA_TARGETS = {
    "llama": {"q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
              "gate": ("mlp", "w_gate"), "up": ("mlp", "w_up"), "down": ("mlp", "w_down")},
    "gpt2": {"q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
             "up": ("mlp", "w_fc"), "down": ("mlp", "w_proj")},
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021): each targeted projection W gains y = x W + alpha / rank * (x A) B
    with A (in, rank) and B (rank, out); only A and B are trained, the base weights stay frozen (lm/model/lora.py).
    Defaults follow Hugging Face PEFT's `LoraConfig` for Llama: `lora_alpha=8` and `target_modules` q_proj, v_proj."""

    rank: int = 0  # 0: off; PEFT's `r`
    alpha: float = 8.0  # the adapters' output is scaled by alpha / rank (PEFT's `lora_alpha`)
    # comma-separated projections among q, k, v, o, gate, up, down (gpt2: no gate), or "all"
    targets: str = "q,v"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def target_names(self, family: str) -> tuple[str, ...]:
        """The targets in LORA_TARGETS order; ConfigError for a name that `family` does not have."""
        valid = LORA_TARGETS[family]
        asked = [t.strip() for t in self.targets.split(",") if t.strip()]
        if asked == ["all"]:
            return tuple(valid)
        unknown = [t for t in asked if t not in valid]
        if unknown or not asked:
            what = f"names {', '.join(unknown)}, which the {family} block does not have" if unknown else "names nothing"
            raise ConfigError(
                f"model.lora.targets={self.targets!r} {what}. Expected a comma-separated list of the {family} block's "
                f"projections, {', '.join(valid)} (PEFT's q_proj, k_proj, ...; GPT-2's c_fc and mlp.c_proj are up and "
                "down), or all. Fix: e.g. model.lora.targets=q,v (PEFT's default for Llama) or model.lora.targets=all."
            )
        return tuple(t for t in valid if t in asked)

    def validate(self) -> None:
        if self.rank < 0 or not self.alpha > 0:
            raise ConfigError(
                f"model.lora.rank={self.rank} and model.lora.alpha={self.alpha} out of range: rank must be >= 0 (0 = "
                "no adapters) and alpha greater than 0 (the adapters are scaled by alpha / rank). Fix: e.g. "
                "model.lora.rank=8 model.lora.alpha=16."
            )


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts MLPs (lm/model/moe.py): in the layers it selects, the dense SwiGLU MLP becomes `experts` SwiGLU
    experts of width `mlp_dim`, of which a float32 router picks `top_k` per token and mixes their outputs by the
    router's probabilities (renormalised over the top k with `norm_topk_prob`, as Mixtral does and Qwen3-MoE's
    `norm_topk_prob` switches), plus optional always-on shared experts (Qwen2-MoE, DeepSeek). Training adds the
    Switch Transformer's load-balancing loss and ST-MoE's router z-loss, by their weights. Routing is dropless
    (tokens sorted by expert, a grouped matmul) unless `capacity_factor` > 0 (each expert takes at most
    capacity_factor * tokens * top_k / experts tokens of a sequence, the rest are dropped: a dense one-hot dispatch)."""

    experts: int = 0  # routed experts per MoE layer; 0: no MoE layers (every layer has the dense MLP)
    top_k: int = 2  # experts each token is sent to
    mlp_dim: int = 0  # each expert's SwiGLU width; 0: model.mlp_dim (its derived value)
    shared_experts: int = 0  # always-on experts beside the routed ones, as one SwiGLU MLP shared_experts * mlp_dim wide
    shared_gate: bool = False  # Qwen2-MoE: the shared experts' output scaled by sigmoid(x . w), one w per layer
    norm_topk_prob: bool = True  # weights = the top k probabilities divided by their sum (false: the probabilities)
    every: int = 1  # layer i (from 0) is MoE when (i + 1) % every == 0 and i >= first (HF decoder_sparse_step)
    first: int = 0  # the layers before this one keep the dense MLP (DeepSeek's first_k_dense_replace)
    aux_loss_weight: float = 0.01  # the load-balancing loss E * sum_e f_e P_e (1.0 when balanced) in the loss
    z_loss_weight: float = 0.001  # the router z-loss mean(logsumexp(logits)^2) in the loss
    capacity_factor: float = 0.0  # 0: dropless; > 0: dense dispatch with this much capacity per expert and sequence
    router_bias: bool = False  # GPT-OSS: a learned bias on the router's logits
    expert_bias: bool = False  # GPT-OSS: biases on each expert's gate, up and down projections
    # GPT-OSS's clamped SwiGLU, both > 0 or both 0 (plain silu(gate) * up): gate clamped above at swiglu_limit, up
    # to [-limit, limit], then gate * sigmoid(swiglu_alpha * gate) * (up + 1)
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    # DeepSeek-V3's router (lm/model/moe.py `route_grouped`): sigmoid scores, a per-expert correction bias that only
    # steers the choice, the top `topk_groups` of `groups` expert groups first, the weights times `routed_scale`.
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    groups: int = 1  # sigmoid: experts split into this many groups (HF n_group); each group scored by its top 2
    topk_groups: int = 1  # sigmoid: a token's experts come from its best topk_groups groups (HF topk_group)
    routed_scale: float = 1.0  # the routed experts' weights times this (HF routed_scaling_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.first and (layer + 1) % self.every == 0

    def validate(self) -> None:
        if self.experts < 0 or self.mlp_dim < 0 or self.shared_experts < 0 or self.first < 0 or self.every < 1:
            raise ConfigError(
                f"model.moe.experts={self.experts}, mlp_dim={self.mlp_dim}, shared_experts={self.shared_experts}, "
                f"first={self.first} and every={self.every} out of range: every must be >= 1, the others >= 0 "
                "(experts 0: no MoE layers; mlp_dim 0: model.mlp_dim). Fix: e.g. model.moe.experts=8 model.moe.every=1."
            )
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ConfigError(
                f"model.moe.top_k={self.top_k} with model.moe.experts={self.experts}: each token goes to top_k distinct "
                f"experts, so 1 <= top_k <= experts. Fix: e.g. model.moe.top_k={min(2, self.experts)}."
            )
        if self.aux_loss_weight < 0 or self.z_loss_weight < 0 or self.capacity_factor < 0:
            raise ConfigError(
                f"model.moe.aux_loss_weight={self.aux_loss_weight}, z_loss_weight={self.z_loss_weight} and "
                f"capacity_factor={self.capacity_factor} must be >= 0 (0: no load-balancing loss, no z-loss, dropless "
                "routing). Fix: e.g. model.moe.aux_loss_weight=0.01 model.moe.z_loss_weight=0.001."
            )
        if self.shared_gate and not self.shared_experts:
            raise ConfigError(
                "model.moe.shared_gate=true gates the shared experts' output, but model.moe.shared_experts=0. Fix: "
                "model.moe.shared_experts=1 (Qwen2-MoE has one shared expert), or model.moe.shared_gate=false."
            )
        if self.expert_bias and self.capacity_factor:
            raise ConfigError(
                f"model.moe.expert_bias=true with model.moe.capacity_factor={self.capacity_factor}: the experts' "
                "down-projection bias is added by the routing weights after a dropless dispatch; a capacity "
                "dispatch would add it for assignments it dropped. Fix: model.moe.capacity_factor=0 (dropless, as "
                "GPT-OSS routes)."
            )
        if self.swiglu_limit < 0 or self.swiglu_alpha < 0 or (self.swiglu_limit > 0) != (self.swiglu_alpha > 0):
            raise ConfigError(
                f"model.moe.swiglu_limit={self.swiglu_limit} and model.moe.swiglu_alpha={self.swiglu_alpha}: GPT-OSS's "
                "clamped SwiGLU takes both (each greater than 0), the plain SwiGLU neither (both 0). Fix: e.g. "
                "model.moe.swiglu_limit=7 model.moe.swiglu_alpha=1.702 (GPT-OSS), or both 0."
            )
        self._check_grouped()

    def _check_grouped(self) -> None:
        """DeepSeek's group-limited sigmoid routing: groups of equal size, enough experts in the chosen groups."""
        grouped = self.groups != 1 or self.topk_groups != 1
        if grouped and self.scoring != "sigmoid":
            raise ConfigError(
                f"model.moe.groups={self.groups} and topk_groups={self.topk_groups} with model.moe.scoring="
                f"{self.scoring}: group-limited routing is DeepSeek-V3's sigmoid router's. Fix: model.moe.scoring="
                "sigmoid, or model.moe.groups=1 model.moe.topk_groups=1."
            )
        per_group = self.experts // self.groups if self.groups > 0 and self.experts % self.groups == 0 else 0
        if self.experts and (not 1 <= self.topk_groups <= self.groups or not per_group
                             or (grouped and per_group < 2) or self.topk_groups * per_group < self.top_k):
            raise ConfigError(
                f"model.moe.groups={self.groups}, topk_groups={self.topk_groups} with experts={self.experts} and "
                f"top_k={self.top_k}: groups must divide the experts into groups of at least 2 (a group is scored by "
                "its best two), 1 <= topk_groups <= groups, and the chosen groups must hold top_k experts. Fix: e.g. "
                "DeepSeek-V3's model.moe.groups=8 model.moe.topk_groups=4 for 256 experts and top_k 8."
            )
        if not self.routed_scale > 0:
            raise ConfigError(
                f"model.moe.routed_scale={self.routed_scale} must be greater than 0 (it multiplies the routed "
                "experts' weights). Fix: model.moe.routed_scale=1, or the model's routed_scaling_factor (2.5 in "
                "DeepSeek-V3)."
            )


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, lm/model/mla.py): keys and values come from one compressed
    latent of `kv_lora_rank` values per token (normed, then expanded per head by kv_b), beside a decoupled RoPE key
    of `qk_rope_head_dim` values shared by all heads. Each head's query and key are a `qk_nope_head_dim` part without
    positions and a `qk_rope_head_dim` part with; its value has `v_head_dim`. The decode caches hold only the latent
    and the RoPE key: kv_lora_rank + qk_rope_head_dim values per token and layer."""

    kv_lora_rank: int = 0  # 0: off (the model's attention is grouped-query attention)
    q_lora_rank: int = 0  # > 0: queries through a normed low-rank bottleneck (q_a, q_b); 0: one projection
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE on pairs of adjacent dimensions (x0, x1), (x2, x3), ... of the rope part (DeepSeek's layout, HF's
    # rope_interleave) instead of rotate-half's (x_i, x_{i + n/2}).
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values a cached token takes per layer: the latent and the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def validate(self) -> None:
        sizes = {"kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank,
                 "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
                 "v_head_dim": self.v_head_dim}
        if any(v < 0 for v in sizes.values()) or (self.kv_lora_rank and (
                self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2 or not self.v_head_dim)):
            raise ConfigError(
                f"model.mla sizes {', '.join(f'{k}={v}' for k, v in sizes.items())} out of range: all >= 0, and "
                "with kv_lora_rank > 0 an even qk_rope_head_dim (RoPE turns pairs) and v_head_dim > 0. Fix: take them "
                "from the model's Hugging Face config (DeepSeek-V3: kv_lora_rank=512 q_lora_rank=1536 "
                "qk_nope_head_dim=128 qk_rope_head_dim=64 v_head_dim=128)."
            )
