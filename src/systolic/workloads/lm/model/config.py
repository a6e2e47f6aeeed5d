"""The lm model's config sections: a decoder-only transformer (ModelConfig), with its sub-sections (RoPE scaling,
LoRA adapters, mixture-of-experts MLPs, latent attention) in sections.py, and how its layers run over pipeline
stages (PipelineConfig, the run's `pipeline` section). What the layers (this package) and the Hugging Face
conversion read."""

from __future__ import annotations

import dataclasses
from typing import Literal

from systolic.config import check_positive, divisor_near
from systolic.errors import ConfigError
from systolic.workloads.lm.model.sections import LoraConfig, MlaConfig, MoeConfig, RopeScalingConfig

MAX_LAYERS = 1024  # far above any published decoder (Llama 3.1 405B: 126); keeps a typo from tracing for an hour

# `model.remat`, written once: what a layer keeps for the backward pass (lm/model/remat.py), most memory first, and
# what each recomputes (for a plan's notes). remat.py's policies and model/sizes.py's counts read these names.
REMAT_POLICIES = {
    "none": "no rematerialisation",
    "dots": "remat=dots recomputes the layers' non-matmul work",
    "except_mlp": "remat=except_mlp recomputes the MLP's up and gate projections and the non-matmul work",
    "attn": "remat=attn recomputes all but the attention's q, k, v and output",
    "context": "remat=context recomputes all but the attention's output (the kernel's forward does not run again)",
    "full": "remat=full recomputes each layer's forward",
}
REMATS = tuple(REMAT_POLICIES)
# What `systolic plan --search` tries, in this order: each saves less than the one before, so fits at least its batch.
SEARCHED_REMATS = ("none", "dots", "full")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. `family` picks the Llama or GPT-2 block; 0 means "derive it". Within the llama
    family, `qkv_bias` (Qwen2), `qk_norm` (Qwen3), `sliding_window` (Mistral), `layer_types` (Qwen2 and Gemma 2/3's
    mix of sliding and full layers), `rope_scaling` (Llama 3.1), and Gemma's `mlp_activation`, `embed_multiplier`,
    `norm_placement`, `attn_logit_scale`, the soft-caps and `rope_local_theta`, Phi-3's `partial_rotary_factor`,
    OLMo 2's post-norms and `qk_norm_scope`, SmolLM3's `no_rope_layers`, Granite's `residual_multiplier` and
    `logit_divisor`, and GPT-OSS's `attn_sinks` and `attn_out_bias` switch on what the open model families add to the
    block; `mla` replaces its attention by DeepSeek-V3's."""

    family: Literal["llama", "gpt2"] = "llama"
    vocab_size: int = 0  # 0: the tokenizer's vocabulary, rounded up to `vocab_multiple`
    vocab_multiple: int = 64
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 0  # 0: same as heads (no grouped-query attention)
    head_dim: int = 0  # 0: d_model // heads
    mlp_dim: int = 0  # 0: 4 * d_model for gpt2; SwiGLU's 8/3 * d_model rounded up to 64 for llama
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = RopeScalingConfig()
    lora: LoraConfig = LoraConfig()  # low-rank adapters: train those alone, on frozen weights (init.from)
    moe: MoeConfig = MoeConfig()  # mixture-of-experts MLPs in some or all layers (llama family)
    mla: MlaConfig = MlaConfig()  # multi-head latent attention instead of grouped-query (DeepSeek-V3; llama family)
    qkv_bias: bool = False  # llama family: biases on the q, k and v projections (not on the output projection)
    qk_norm: bool = False  # llama family: RMSNorm of each head's q and k before RoPE, one scale per head_dim entry
    # head: each head's q and k normed over head_dim (Qwen3, Gemma 3); all: q and k normed over all their heads at
    # once, one scale per (head, head_dim) entry (OLMo 2)
    qk_norm_scope: Literal["head", "all"] = "head"
    sliding_window: int = 0  # > 0: a query attends to itself and the sliding_window - 1 positions before it
    # Per layer, "sliding" (within sliding_window) or "full" (every earlier position); (): every layer sliding when
    # sliding_window > 0, else full. Gemma 2 alternates sliding and full, Gemma 3 has five sliding layers per full one.
    layer_types: tuple[Literal["sliding", "full"], ...] = ()
    rope_local_theta: float = 0.0  # > 0: the sliding layers' RoPE base, unscaled (Gemma 3); 0: rope_theta everywhere
    partial_rotary_factor: float = 1.0  # RoPE rotates the first int(head size * this) dimensions of q and k (Phi-4-mini)
    no_rope_layers: tuple[int, ...] = ()  # layers (from 0) whose q and k are not rotated at all (SmolLM3's NoPE layers)
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"  # llama family: SwiGLU's gate, or GeGLU's (Gemma)
    embed_multiplier: float = 1.0  # the embeddings times this into the residual stream (Gemma: sqrt(d_model))
    # pre: x + f(norm(x)). sandwich: x + norm(f(norm(x))), a second norm on each sublayer's output (Gemma 2/3).
    # post: x + norm(f(x)), the sublayer's output normed and its input not (OLMo 2)
    norm_placement: Literal["pre", "sandwich", "post"] = "pre"
    # attention logits q.k times this; 0: 1/sqrt(head size). Gemma 2/3: 1/sqrt(query_pre_attn_scalar)
    attn_logit_scale: float = 0.0
    attn_logit_softcap: float = 0.0  # > 0: attention logits s -> cap * tanh(s / cap) before the softmax (Gemma 2)
    final_logit_softcap: float = 0.0  # > 0: output logits z -> cap * tanh(z / cap) (Gemma 2)
    # GPT-OSS: a learned logit per query head that joins each softmax's denominator (attention "sinks": a query may
    # attend to nothing), and a bias on the attention's output projection
    attn_sinks: bool = False
    attn_out_bias: bool = False
    residual_multiplier: float = 1.0  # each sublayer's output times this before it joins the residual (Granite)
    logit_divisor: float = 1.0  # the output logits divided by this (Granite's logits_scaling)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # compute dtype; parameters stay float32
    # What a layer keeps for the backward pass (REMAT_POLICIES, lm/model/remat.py): none keeps everything; the
    # others keep less and recompute more, in their order
    remat: Literal[REMATS] = "none"
    # The projections' operands (lm/model/quant.py, through Qwix): int8 / fp8 quantize activations and weights
    # (per row, per output channel) into an int8 x int8 (fp8) dot; in training the backward pass goes straight
    # through to the float32 weights (quantization-aware training); float32 master weights and optimizer state.
    quant: Literal["none", "int8", "fp8"] = "none"
    # training attention: auto = splash on TPU, cuDNN on GPU, lm/model/cpu.py on CPU (see workloads/lm/model/attention.py)
    attention: Literal["auto", "splash", "cudnn", "xla"] = "auto"
    # attention when mesh.context > 1 splits the sequence (workloads/lm/parallel/context.py): ring = key/value blocks passed
    # round the ring with flash-style accumulation (memory per device falls with the ring); allgather = keys and
    # values gathered whole, then plain attention (fewer, larger messages; for small rings)
    context_attention: Literal["ring", "allgather"] = "ring"
    scan_layers: bool = False
    # muP (Yang et al., Tensor Programs V): initialisation, per-layer learning rates, output multiplier and attention
    # scale that make the best learning rate independent of d_model (lm/model/parametrization.py). The model equals the
    # standard one at d_model = mup_base_width: tune there, then widen.
    parametrization: Literal["standard", "mup"] = "standard"
    mup_base_width: int = 256

    @property
    def width_mult(self) -> float:
        """muP's width multiplier d_model / mup_base_width; 1 under the standard parametrization."""
        return self.d_model / self.mup_base_width if self.parametrization == "mup" else 1.0

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.d_model // self.heads

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Whether each layer attends within model.sliding_window (a sliding layer) or to every earlier position."""
        if self.layer_types:
            return tuple(kind == "sliding" for kind in self.layer_types)
        return (self.sliding_window > 0,) * self.layers

    @property
    def d_rope(self) -> int:
        """The dimensions of each q and k head that RoPE rotates (the first ones; the rest pass unrotated): MLA's
        decoupled RoPE part, else the head size times partial_rotary_factor."""
        if self.mla.kv_lora_rank:
            return self.mla.qk_rope_head_dim
        return int(self.d_head * self.partial_rotary_factor)

    @property
    def rope_layers(self) -> tuple[bool, ...]:
        """Whether each layer rotates q and k (false for model.no_rope_layers)."""
        return tuple(i not in self.no_rope_layers for i in range(self.layers))

    @property
    def d_expert(self) -> int:
        """Each expert's MLP width (model.moe.mlp_dim, else the dense MLP's)."""
        return self.moe.mlp_dim or self.d_mlp

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (none without model.moe.experts)."""
        return tuple(i for i in range(self.layers) if self.moe.is_moe_layer(i))

    @property
    def d_mlp(self) -> int:
        if self.mlp_dim:
            return self.mlp_dim
        if self.family == "gpt2":
            return 4 * self.d_model
        return -(-(8 * self.d_model // 3) // 64) * 64

    def padded_vocab(self, tokenizer_vocab: int) -> int:
        """Vocabulary rows in the embedding: the tokenizer's, rounded up so the table shards evenly."""
        vocab = self.vocab_size or tokenizer_vocab
        if vocab < tokenizer_vocab:
            raise ConfigError(
                f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary ({tokenizer_vocab}); tokens "
                f"would index past the embedding table. Fix: set model.vocab_size=0 (derive it) or >= {tokenizer_vocab}."
            )
        return -(-vocab // self.vocab_multiple) * self.vocab_multiple

    def validate(self) -> None:
        check_positive(self, "model", ("vocab_multiple", "d_model", "layers", "heads", "max_seq_len", "mup_base_width"))
        if self.layers > MAX_LAYERS:
            raise ConfigError(
                f"model.layers={self.layers} is more than {MAX_LAYERS} layers. The deepest published decoders have "
                "about 130, and tracing an unscanned stack takes time per layer, so this many would spend many "
                f"minutes before failing. Expected 1 to {MAX_LAYERS}. Fix: e.g. model.layers=32 (with "
                "model.scan_layers=true for deep stacks)."
            )
        for name in ("vocab_size", "kv_heads", "head_dim", "mlp_dim"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"model.{name}={getattr(self, name)} must be >= 0 (0 means: derive it from the other sizes). "
                    f"Fix: e.g. model.{name}=0."
                )
        if self.init_std <= 0 or self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ConfigError(
                f"model.init_std={self.init_std}, model.rope_theta={self.rope_theta} and model.norm_eps={self.norm_eps} "
                "must all be greater than 0. Fix: use the defaults (0.02, 10000, 1e-5) or other positive values."
            )
        if self.rope_scaling.type == "yarn" and self.rope_theta <= 1:
            raise ConfigError(
                f"model.rope_theta={self.rope_theta} with model.rope_scaling.type=yarn: YaRN finds the dimensions to "
                "stretch by dividing by ln(rope_theta), which is 0 at 1 (and turns the frequencies' order round "
                "below it). Expected the model's base, greater than 1 (10000, 500000, 1000000). Fix: e.g. "
                "model.rope_theta=10000, as the model's Hugging Face config.json says."
            )
        if not self.head_dim and self.d_model % self.heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.heads={self.heads}, so the head size is not "
                f"an integer. Fix: choose heads that divide d_model (e.g. model.heads={divisor_near(self.d_model, self.heads)}) "
                "or set model.head_dim explicitly."
            )
        if self.heads % self.n_kv_heads:
            raise ConfigError(
                f"model.heads={self.heads} is not a multiple of model.kv_heads={self.n_kv_heads}; grouped-query "
                "attention shares each key/value head between an equal number of query heads. Fix: pick kv_heads "
                f"dividing heads, e.g. model.kv_heads={divisor_near(self.heads, self.n_kv_heads)}."
            )
        if self.sliding_window < 0:
            raise ConfigError(
                f"model.sliding_window={self.sliding_window} must be >= 0: 0 attends to every earlier position, W > 0 "
                "to the query and the W - 1 positions before it. Fix: model.sliding_window=0, or the model's window."
            )
        llama_only = {"model.qkv_bias=true": self.qkv_bias, "model.qk_norm=true": self.qk_norm,
                      f"model.rope_scaling.type={self.rope_scaling.type}": self.rope_scaling.type != "none",
                      f"model.rope_local_theta={self.rope_local_theta}": self.rope_local_theta,
                      f"model.mlp_activation={self.mlp_activation}": self.mlp_activation != "silu",
                      f"model.embed_multiplier={self.embed_multiplier}": self.embed_multiplier != 1,
                      f"model.norm_placement={self.norm_placement}": self.norm_placement != "pre",
                      f"model.attn_logit_scale={self.attn_logit_scale}": self.attn_logit_scale,
                      f"model.attn_logit_softcap={self.attn_logit_softcap}": self.attn_logit_softcap,
                      f"model.final_logit_softcap={self.final_logit_softcap}": self.final_logit_softcap,
                      "model.attn_sinks=true": self.attn_sinks, "model.attn_out_bias=true": self.attn_out_bias,
                      f"model.qk_norm_scope={self.qk_norm_scope}": self.qk_norm_scope != "head",
                      f"model.partial_rotary_factor={self.partial_rotary_factor}": self.partial_rotary_factor != 1,
                      f"model.no_rope_layers={list(self.no_rope_layers)}": self.no_rope_layers,
                      f"model.residual_multiplier={self.residual_multiplier}": self.residual_multiplier != 1,
                      f"model.logit_divisor={self.logit_divisor}": self.logit_divisor != 1}
        asked = [key for key, on in llama_only.items() if on]
        if self.family == "gpt2" and asked:
            raise ConfigError(
                f"{', '.join(asked)} with model.family=gpt2: these switches change the llama block (rotary positions, "
                "unbiased projections, RMSNorm, a gated MLP, Gemma's scalings); the GPT-2 block has learned positions "
                "and biases on every projection and no such settings. Fix: model.family=llama, or leave them at their "
                "defaults (false, none, 0, silu, 1, pre)."
            )
        self._check_gemma_switches()
        self._check_sinks()
        self._check_family_switches()
        self._check_layer_types()
        if self.lora.rank:
            self.lora.target_names(self.family)  # a ConfigError naming the valid ones
        if self.moe.experts:
            self._check_moe()
        if self.mla.kv_lora_rank:
            self._check_mla()
        if self.family == "llama" and self.d_rope % 2 and self.partial_rotary_factor == 1:
            raise ConfigError(f"Rotary embeddings need an even head size, but the head size is {self.d_head}. Fix: change model.d_model, model.heads or model.head_dim.")
        if self.family == "llama" and (self.d_rope % 2 or not self.d_rope):
            raise ConfigError(
                f"model.partial_rotary_factor={self.partial_rotary_factor} rotates int({self.d_head} x "
                f"{self.partial_rotary_factor}) = {self.d_rope} dimensions of each head, but RoPE rotates pairs: it "
                "needs an even number above 0. Fix: a factor that gives an even count (e.g. 0.5 or 0.75 of a head "
                "size of 128), or model.partial_rotary_factor=1."
            )
        n_pairs = self.d_rope // 2
        if self.rope_scaling.type == "longrope" and len(self.rope_scaling.short_factor) != n_pairs:
            raise ConfigError(
                f"model.rope_scaling.short_factor and long_factor have {len(self.rope_scaling.short_factor)} entries, "
                f"but RoPE rotates {n_pairs} pairs of dimensions per head (head size {self.d_head} x "
                f"partial_rotary_factor {self.partial_rotary_factor} / 2). Fix: one divisor per rotated pair, as the "
                "model's Hugging Face rope_parameters give them."
            )


    def _check_gemma_switches(self) -> None:
        """The scalings and soft-caps: their ranges, and the settings they cannot work with."""
        if (not self.embed_multiplier > 0 or self.attn_logit_scale < 0 or self.attn_logit_softcap < 0
                or self.final_logit_softcap < 0 or self.rope_local_theta < 0):
            raise ConfigError(
                f"model.embed_multiplier={self.embed_multiplier}, attn_logit_scale={self.attn_logit_scale}, "
                f"attn_logit_softcap={self.attn_logit_softcap}, final_logit_softcap={self.final_logit_softcap} and "
                f"rope_local_theta={self.rope_local_theta} out of range: the multiplier must be greater than 0, the "
                "others at least 0 (0: off, or the default 1/sqrt(head size) scale). Fix: take them from the model's "
                "Hugging Face config (e.g. Gemma 2: attn_logit_softcap=50 final_logit_softcap=30), or the defaults."
            )
        if self.attn_logit_scale and self.parametrization == "mup":
            raise ConfigError(
                f"model.attn_logit_scale={self.attn_logit_scale} with model.parametrization=mup: muP sets the "
                "attention logits' scale itself (1/head size), so one of the two would be ignored. Fix: "
                "model.attn_logit_scale=0 under muP, or model.parametrization=standard."
            )
        if self.attn_logit_softcap and self.attention == "cudnn":
            raise ConfigError(
                f"model.attention=cudnn with model.attn_logit_softcap={self.attn_logit_softcap}: cuDNN's flash "
                "attention (jax.nn.dot_product_attention) has no logit soft-capping. Fix: model.attention=auto, which "
                "runs the XLA formulation with the cap on GPU (splash, which caps, on TPU), or model.attention=xla."
            )
        if self.mlp_activation != "silu" and self.moe.experts:
            raise ConfigError(
                f"model.mlp_activation={self.mlp_activation} with model.moe.experts={self.moe.experts}: the experts "
                "are SwiGLU MLPs (silu gates). Fix: model.mlp_activation=silu for a mixture of experts."
            )

    def _check_sinks(self) -> None:
        """Attention sinks need an attention that adds them to its softmax: the plain XLA formulation."""
        if self.attn_sinks and self.attention in ("splash", "cudnn"):
            raise ConfigError(
                f"model.attention={self.attention} with model.attn_sinks=true: the {self.attention} kernel's softmax "
                "has no sink logits (GPT-OSS's per-head term in the denominator). Fix: model.attention=auto, which "
                "runs the XLA formulation with the sinks, or model.attention=xla."
            )
    def _check_family_switches(self) -> None:
        """Phi-3's partial RoPE, OLMo 2's q/k norm scope, SmolLM3's NoPE layers and Granite's multipliers: ranges."""
        bad_layers = [i for i in self.no_rope_layers if not 0 <= i < self.layers]
        if (not 0 < self.partial_rotary_factor <= 1 or not self.residual_multiplier > 0 or not self.logit_divisor > 0
                or bad_layers or len(set(self.no_rope_layers)) != len(self.no_rope_layers)):
            raise ConfigError(
                f"model.partial_rotary_factor={self.partial_rotary_factor}, residual_multiplier="
                f"{self.residual_multiplier}, logit_divisor={self.logit_divisor} or no_rope_layers="
                f"{list(self.no_rope_layers)} out of range: the factor must be in (0, 1], the multiplier and divisor "
                f"greater than 0, and no_rope_layers distinct layer indexes in [0, {self.layers}). Fix: take them from "
                "the model's Hugging Face config (e.g. SmolLM3: every fourth layer, [3, 7, ...]), or the defaults."
            )
        if self.qk_norm_scope != "head" and not self.qk_norm:
            raise ConfigError(
                f"model.qk_norm_scope={self.qk_norm_scope} says how q and k are normed, but model.qk_norm=false, so "
                "they are not. Fix: model.qk_norm=true (OLMo 2: with qk_norm_scope=all), or qk_norm_scope=head."
            )

    def _check_layer_types(self) -> None:
        """model.layer_types names every layer's kind, and a sliding layer has a window; rope_local_theta needs both
        kinds of layer."""
        types = self.layer_types
        if types and (len(types) != self.layers or not self.sliding_window):
            raise ConfigError(
                f"model.layer_types lists {len(types)} layers with model.layers={self.layers} and "
                f"model.sliding_window={self.sliding_window}: it gives each layer's kind, sliding (within the window) "
                "or full, so it needs one entry per layer and a window. Fix: e.g. model.sliding_window=4096 "
                f"model.layer_types=[{', '.join(['sliding', 'full'] * 2)}, ...] with {self.layers} entries, or "
                "model.layer_types=[] (every layer sliding when sliding_window > 0)."
            )
        if self.rope_local_theta and len(set(self.local_layers)) != 2:
            raise ConfigError(
                f"model.rope_local_theta={self.rope_local_theta} gives the sliding layers their own RoPE base, but "
                f"this model's layers are all {'sliding' if self.local_layers[0] else 'full'}, so either it or "
                "model.rope_theta would not act. Fix: model.layer_types with both sliding and full layers, or "
                "model.rope_local_theta=0."
            )

    def _check_mla(self) -> None:
        """What multi-head latent attention does not combine with: settings of the grouped-query attention it
        replaces (its own sizes are model.mla's), GPT-2's block, and what MLA's layers do not implement."""
        asked = {"model.family=gpt2": self.family == "gpt2", f"model.kv_heads={self.kv_heads}": self.kv_heads,
                 f"model.head_dim={self.head_dim}": self.head_dim, "model.qkv_bias=true": self.qkv_bias,
                 "model.qk_norm=true": self.qk_norm, f"model.sliding_window={self.sliding_window}": self.sliding_window,
                 f"model.attn_logit_softcap={self.attn_logit_softcap}": self.attn_logit_softcap,
                 f"model.lora.rank={self.lora.rank}": self.lora.rank,
                 "model.parametrization=mup": self.parametrization == "mup",
                 f"model.rope_local_theta={self.rope_local_theta}": self.rope_local_theta,
                 "model.attn_sinks=true": self.attn_sinks, "model.attn_out_bias=true": self.attn_out_bias,
                 f"model.partial_rotary_factor={self.partial_rotary_factor}": self.partial_rotary_factor != 1,
                 f"model.no_rope_layers={list(self.no_rope_layers)}": self.no_rope_layers}
        bad = [key for key, on in asked.items() if on]
        if bad:
            raise ConfigError(
                f"{', '.join(bad)} with multi-head latent attention (model.mla.kv_lora_rank={self.mla.kv_lora_rank}): "
                "MLA's heads read one shared latent with sizes of their own (model.mla), full causal attention with RoPE "
                "on every layer over its qk_rope_head_dim, no biases, sinks, norms of q/k heads, soft-cap, LoRA "
                "adapters or muP scaling. Fix: leave these at their defaults (kv_heads=0, head_dim=0, false, 0, 1, [], "
                "standard), or model.mla.kv_lora_rank=0."
            )

    def _check_moe(self) -> None:
        moe = self.moe
        if self.family != "llama":
            raise ConfigError(
                f"model.moe.experts={moe.experts} with model.family={self.family}: the experts are SwiGLU MLPs of the "
                "llama block (Mixtral, Qwen-MoE, DeepSeek). Fix: model.family=llama, or model.moe.experts=0."
            )
        if not self.moe_layers:
            raise ConfigError(
                f"model.moe.experts={moe.experts} but no layer is a MoE layer: with model.moe.first={moe.first} and "
                f"model.moe.every={moe.every}, none of the model.layers={self.layers} layers qualifies (layer i when "
                f"(i + 1) % every == 0 and i >= first). Fix: e.g. model.moe.first=0 model.moe.every=1."
            )
        if self.scan_layers and len(self.moe_layers) != self.layers:
            raise ConfigError(
                f"model.scan_layers=true stacks identical layers, but model.moe.first={moe.first} and "
                f"model.moe.every={moe.every} make {len(self.moe_layers)} of the {self.layers} layers MoE and the rest "
                "dense. Fix: model.scan_layers=false, or MoE in every layer (model.moe.first=0 model.moe.every=1)."
            )
        mlp_targets = {"gate", "up", "down"} & set(self.lora.target_names(self.family)) if self.lora.rank else set()
        if mlp_targets:
            raise ConfigError(
                f"model.lora.targets={self.lora.targets!r} adapts MLP projections ({', '.join(sorted(mlp_targets))}), "
                "but this model's MLPs are mixtures of experts, which have no LoRA adapters. Fix: adapt the attention "
                "only, e.g. model.lora.targets=q,k,v,o."
            )


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The `pipeline` section: how the layers run over the `mesh.stage` axis (lm/parallel/pipeline.py). It acts only with
    mesh.stage > 1; checked against the mesh in `preflight.check_pipeline`."""

    # The batch (each grad_accum micro-step's) is cut into this many microbatches that follow each other through the
    # stages; the idle share of a step (the bubble) is (stages - 1) / (repeats * microbatches + stages - 1).
    microbatches: int = 1
    # 1: GPipe, each stage holds one group of consecutive layers. r > 1: the circular (interleaved) schedule, each
    # stage holds r groups (stage s the groups s, s + stages, ...) and every microbatch goes round the stages r times.
    repeats: int = 1

    def validate(self) -> None:
        if self.microbatches < 1 or self.repeats < 1:
            raise ConfigError(
                f"pipeline.microbatches={self.microbatches} and pipeline.repeats={self.repeats}: both count things "
                "and must be at least 1. Fix: e.g. pipeline.microbatches=8 pipeline.repeats=1 (GPipe).")
