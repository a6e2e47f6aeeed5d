"""Hugging Face `config.json` <-> the lm workload's `ModelConfig`: Llama (incl. Llama 3.1+ RoPE scaling and
SmolLM's small, tied variants), Qwen2/2.5, Qwen3, Mistral, Gemma, Gemma 2, Gemma 3 (text), Phi-3/Phi-4, OLMo 2,
SmolLM3, Granite, GPT-OSS, the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE (model.moe), DeepSeek-V3
(multi-head latent attention: lm/hf/deepseek.py), and GPT-2.

The Llama-like architectures are one systolic family, `llama`, with switches (`model.qkv_bias`, `model.qk_norm`,
`model.sliding_window`, `model.rope_scaling`, Gemma's and the other families' own: lm/hf/families.py): import maps
an architecture's settings onto switches, and export writes the architecture the switches call for. Only what the
systolic model computes is accepted: a setting that would change the math (dynamic RoPE, partial rotary embeddings
outside Phi-3, an output-projection bias, an exact-erf GELU in GPT-2, bidirectional attention) is an error that
names it rather than a silently different model after import. The switches each architecture sets, the export
rules, and the MoE families' routing and load-balancing coefficient: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from systolic import config as config_lib
from systolic import safe_json
from systolic.errors import ConfigError, UserError
from systolic.workloads.lm.model.config import MAX_LAYERS, ModelConfig
from systolic.workloads.lm.model.sections import MoeConfig, RopeScalingConfig
from systolic.workloads.lm.hf import deepseek, families
from systolic.workloads.lm.hf.architectures import ARCHITECTURES
from systolic.workloads.lm.hf.config_rules import SUPPORTED_LIST, require, unsupported
from systolic.workloads.lm.hf.rope_config import rope_from_hf, rope_to_hf
from systolic.workloads.lm.hf.tensors import hf_gemma, hf_gpt_oss, hf_mixtral

GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
QWEN2_BIASES = ("qwen2", "qwen2_moe")  # q/k/v biases by architecture (Qwen2-MoE: its `qkv_bias`, default true)
def read_config(src: Path) -> dict[str, Any]:
    path = Path(src) / "config.json"
    if not path.is_file():
        raise UserError(
            f"{src} has no config.json, so it is not a Hugging Face model folder. Expected a local folder with "
            "config.json and model.safetensors (or model-*.safetensors with model.safetensors.index.json), as "
            "`save_pretrained` or `huggingface-cli download` writes it. Fix: pass such a folder."
        )
    expected, fix = "a Hugging Face config.json: an object of model settings", "restore the file from the model's source."
    return safe_json.expect_object(safe_json.read_file(path, expected=expected, fix=fix, max_bytes=CONFIG_MAX_BYTES),
                                   str(path), expected=expected, fix=fix)


def model_config(hf: dict[str, Any], src: Path, *, scan_layers: bool = False) -> ModelConfig:
    """Our ModelConfig for a config.json of one of ARCHITECTURES; the vocabulary is exactly HF's `vocab_size`.
    Every value is checked (types, ranges, then the ModelConfig's own validation) before it is used, and any
    failure is a UserError naming config.json."""
    model_type = _model_type(hf, src)
    _check_values(hf, src)
    quant_method(hf, src)  # a quantization other than MXFP4 experts is refused by name
    try:
        built = _model_config(hf, src, model_type, scan_layers)
        # Through the schema, as a recipe's model section is: types coerced, every range validated.
        return config_lib.from_dict(ModelConfig, config_lib.to_dict(built), "model.")
    except KeyError as e:
        raise UserError(
            f"{src}/config.json has no {e.args[0]!r}, which a {ARCHITECTURES[model_type]} config needs. Fix: restore "
            "the file from the model's source (transformers' save_pretrained writes every key)."
        ) from None
    except ConfigError as e:
        # Its fix names systolic's keys, which an imported model does not choose.
        problem = str(e).split(" Fix: ")[0].rstrip(".")
        raise UserError(
            f"{src}/config.json describes a model systolic cannot build: {problem} (config.json's hidden_size, "
            "num_attention_heads, num_key_value_heads and head_dim are model.d_model, heads, kv_heads and head_dim). "
            f"The families and settings that convert are listed in {SUPPORTED_LIST}. Fix: pass a checkpoint whose "
            "sizes fit those rules; these weights cannot be converted as they are."
        ) from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as e:
        raise UserError(
            f"{src}/config.json holds a value of the wrong type or range ({type(e).__name__}: {e}). Expected the "
            "settings a transformers save_pretrained writes: integers for sizes, numbers for rates, objects for "
            "rope_scaling. Fix: restore the file from the model's source."
        ) from None


# Keys read as integers (sizes; the first group must be positive) and as finite numbers, where present.
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                  "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions")
_INTS = ("num_key_value_heads", "head_dim", "n_inner", "num_local_experts", "num_experts", "num_experts_per_tok",
         "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step", "sliding_window",
         "max_window_layers", "original_max_position_embeddings", "sliding_window_pattern",
         # DeepSeek-V3's (lm/hf/deepseek.py)
         "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
         "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace", "num_nextn_predict_layers")
_NUMBERS = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta", "router_aux_loss_coef", "partial_rotary_factor",
            "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq",
            "swiglu_alpha", "swiglu_limit", "routed_scaling_factor", "embedding_multiplier", "residual_multiplier",
            "attention_multiplier", "logits_scaling")
CONFIG_MAX_BYTES = 4 << 20


def _check_values(hf: dict[str, Any], src: Path) -> None:
    """The types and ranges of the config.json values that become sizes, before any arithmetic on them."""
    def bad(key: str, expected: str) -> UserError:
        return UserError(f"{src}/config.json sets {key} = {hf[key]!r}; expected {expected}. Fix: restore the file "
                         "from the model's source.")

    for key in (*_POSITIVE_INTS, *_INTS):
        value = hf.get(key)
        if value is None and key not in _POSITIVE_INTS:
            continue
        if key not in hf:
            continue  # a missing required key is reported by name where it is read
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key in _POSITIVE_INTS else 0):
            raise bad(key, "a positive integer" if key in _POSITIVE_INTS else "an integer >= 0 (or null)")
        if value > 2**40:
            raise bad(key, "a size a model could have (at most 2**40)")
    for key in ("num_hidden_layers", "n_layer"):
        if isinstance(hf.get(key), int) and hf[key] > MAX_LAYERS:
            raise bad(key, f"at most {MAX_LAYERS} layers (the deepest published decoders have about 130)")
    for key in _NUMBERS:
        value = hf.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)):
            raise bad(key, "a finite number")
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise bad(key, "an object of RoPE parameters, or null")


def _model_config(hf: dict[str, Any], src: Path, model_type: str, scan_layers: bool) -> ModelConfig:
    vocab = int(hf["vocab_size"])
    # vocab_multiple divides vocab, so the padded vocabulary is vocab itself: no extra logit rows.
    common = dict(vocab_size=vocab, vocab_multiple=math.gcd(vocab, 64), scan_layers=scan_layers)
    if model_type == "gpt2":
        return _gpt2_config(hf, src, common)
    if model_type in GEMMA_TYPES:
        return _gemma_config(hf, src, model_type, common)
    if model_type == "gpt_oss":
        return _gpt_oss_config(hf, src, common)
    if model_type == deepseek.MODEL_TYPE:
        return deepseek.model_config(hf, src, common)
    # Qwen2's q/k/v biases come with the architecture; attention_bias (Llama, Qwen3) would add an o_proj bias too.
    require(hf, src, {"hidden_act": "silu", "mlp_bias": False,
                       **({} if model_type in QWEN2_BIASES else {"attention_bias": False})})
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    theta, scaling = rope_from_hf(hf, src, hf.get("rope_scaling") or hf.get("rope_parameters") or {},
                           partial=model_type == "phi3")
    window, layer_types = _sliding_window(hf, src, model_type)
    return ModelConfig(
        **common, family="llama", d_model=d, layers=hf["num_hidden_layers"], heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads, head_dim=0 if head_dim == d // heads else head_dim,
        mlp_dim=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"], rope_theta=theta,
        rope_scaling=scaling, qkv_bias=model_type in QWEN2_BIASES and bool(hf.get("qkv_bias", True)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "olmo2"), sliding_window=window, layer_types=layer_types,
        norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", model_type == "smollm3")),
        moe=_moe(hf, src, model_type) if model_type in MOE_TYPES else MoeConfig(),
        **families.switches(hf, src, model_type),
    )


# PHI-3, OLMO 2, SMOLLM3, GRANITE: Llama's block with their switches ---------------------------------------------

def _gemma_config(hf: dict[str, Any], src: Path, model_type: str, common: dict[str, Any]) -> ModelConfig:
    """Gemma, Gemma 2 and Gemma 3's text model: the llama block with Gemma's switches (the module docstring)."""
    # Gemma's config maps the released checkpoints' legacy "gelu" to the tanh approximation itself; Gemma 2/3 take
    # hidden_activation as written (exact "gelu" would be erf).
    act_key, legacy = ("hidden_act", ("gelu",)) if model_type == "gemma" else ("hidden_activation", ())
    if hf.get(act_key, "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", *legacy):
        raise unsupported(src, act_key, hf[act_key], "gelu_pytorch_tanh (GeGLU, GELU's tanh approximation)")
    require(hf, src, {"attention_bias": False})
    if hf.get("use_bidirectional_attention"):
        raise unsupported(src, "use_bidirectional_attention", True, "false (causal attention)")
    d, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or d // heads
    out = dict(common, family="llama", d_model=d, layers=layers, heads=heads,
               kv_heads=hf.get("num_key_value_heads") or heads, head_dim=0 if head_dim == d // heads else head_dim,
               mlp_dim=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"], norm_eps=hf["rms_norm_eps"],
               tie_embeddings=bool(hf.get("tie_word_embeddings", True)), mlp_activation="gelu_tanh",
               embed_multiplier=d**0.5)  # as transformers computes it, then rounded to the compute dtype
    if model_type == "gemma":
        theta, scaling = rope_from_hf(hf, src, hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        return ModelConfig(**out, rope_theta=theta, rope_scaling=scaling)
    pattern = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern") or 6)  # transformers' defaults
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(layers)]
    window, layer_types = _layer_kinds(hf, src, types, hf.get("sliding_window"))
    out.update(norm_placement="sandwich", attn_logit_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
               final_logit_softcap=float(hf.get("final_logit_softcapping") or 0.0), sliding_window=window,
               layer_types=layer_types)
    if model_type == "gemma2":
        theta, scaling = rope_from_hf(hf, src, hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        return ModelConfig(**out, rope_theta=theta, rope_scaling=scaling,
                           attn_logit_softcap=float(hf.get("attn_logit_softcapping") or 0.0))
    # Gemma 3: transformers' Gemma3Attention does not apply attn_logit_softcapping (the released configs set it
    # null), so it is not read here either: the import computes what transformers does.
    theta, scaling, local_theta = _gemma3_rope(hf, src)
    kinds = set(ModelConfig(**out).local_layers)
    if kinds == {True}:  # only sliding layers: theirs is the one base
        theta, scaling, local_theta = local_theta, RopeScalingConfig(), 0.0
    return ModelConfig(**out, qk_norm=True, rope_theta=theta, rope_scaling=scaling,
                       rope_local_theta=local_theta if len(kinds) == 2 else 0.0)


def quant_method(hf: dict[str, Any], src: Path) -> str | None:
    """config.json's quantization_config.quant_method: None (float weights) or mxfp4 (GPT-OSS's experts, which
    the import dequantizes); any other is a UserError naming it."""
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method != "mxfp4" or hf.get("model_type") != "gpt_oss":
        raise unsupported(src, "quantization_config.quant_method", method, "no quantization_config (float weights), "
                           "or mxfp4 on a GPT-OSS model's experts, which the import dequantizes")
    return method


def _gpt_oss_config(hf: dict[str, Any], src: Path, common: dict[str, Any]) -> ModelConfig:
    """GPT-OSS: the llama block with sinks, attention biases, alternating windows and its experts (module
    docstring)."""
    d, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or d // heads
    theta, scaling = rope_from_hf(hf, src, hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    window, layer_types = _layer_kinds(hf, src, types, hf.get("sliding_window"))
    top_k = int(hf["num_experts_per_tok"])
    # transformers before swiglu_alpha was a setting computed 1.702 (GptOssConfig's default now).
    moe = MoeConfig(experts=int(hf["num_local_experts"]), top_k=top_k, mlp_dim=int(hf["intermediate_size"]),
                    norm_topk_prob=True, aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)) * top_k,
                    router_bias=True, expert_bias=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                    swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
    bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        **common, family="llama", d_model=d, layers=layers, heads=heads, kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=0 if head_dim == d // heads else head_dim, mlp_dim=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"], rope_theta=theta, rope_scaling=scaling, qkv_bias=bias,
        attn_out_bias=bias, attn_sinks=True, sliding_window=window, layer_types=layer_types,
        norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=moe,
    )


def _gemma3_rope(hf: dict[str, Any], src: Path) -> tuple[float, RopeScalingConfig, float]:
    """(the full layers' theta and scaling, the sliding layers' theta) of a Gemma 3 config.json: per layer type in
    `rope_parameters` (transformers 5), or rope_theta, rope_scaling and rope_local_base_freq (4.x)."""
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict) or isinstance(params.get("sliding_attention"), dict):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta, scaling = rope_from_hf({**hf, "rope_theta": 1e6}, src, full)
        local_theta = float(local.get("rope_theta") or 1e4)
    else:
        theta, scaling = rope_from_hf({**hf, "rope_theta": hf.get("rope_theta") or 1e6}, src,
                                      hf.get("rope_scaling") or {})
        local, local_theta = {}, float(hf.get("rope_local_base_freq") or 1e4)
    if local.get("rope_type", "default") != "default" or local.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise unsupported(src, "rope_parameters.sliding_attention", local,
                           "the default RoPE on the sliding layers (only the full layers' RoPE is scaled)")
    return theta, scaling, local_theta


def _layer_kinds(hf: dict[str, Any], src: Path, types: list[Any], window: Any) -> tuple[int, tuple[str, ...]]:
    """(model.sliding_window, model.layer_types) for transformers' `layer_types` with `window` on its sliding
    layers (None: no window anywhere): one kind on every layer needs no list."""
    if not isinstance(types, list) or len(types) != hf["num_hidden_layers"] or \
            set(types) - {"full_attention", "sliding_attention"}:
        raise unsupported(src, "layer_types", types, f"a list of {hf['num_hidden_layers']} entries, each "
                           "full_attention or sliding_attention")
    if window is None or "sliding_attention" not in types:
        return 0, ()
    if "full_attention" not in types:
        return int(window), ()
    return int(window), tuple("sliding" if t == "sliding_attention" else "full" for t in types)


def _moe(hf: dict[str, Any], src: Path, model_type: str) -> MoeConfig:
    """model.moe of a Mixtral or Qwen-MoE config.json."""
    top_k = int(hf["num_experts_per_tok"])
    aux = float(hf.get("router_aux_loss_coef", 0.001)) * top_k  # HF's shares sum to top_k, ours to 1
    if model_type == "mixtral":
        require(hf, src, {"router_jitter_noise": 0.0})
        return MoeConfig(experts=int(hf["num_local_experts"]), top_k=top_k, mlp_dim=int(hf["intermediate_size"]),
                         norm_topk_prob=True, aux_loss_weight=aux)
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)  # transformers 5 writes the latter
    dense = list(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))) or not experts:
        raise unsupported(src, "mlp_only_layers / num_experts", (dense, experts), "the dense layers first "
                           "(mlp_only_layers = [0, 1, ..., n - 1]) and num_experts > 0")
    width = int(hf["moe_intermediate_size"])
    shared, shared_gate = 0, False
    if model_type == "qwen2_moe":
        size = int(hf["shared_expert_intermediate_size"])
        if not size or size % width:
            raise unsupported(src, "shared_expert_intermediate_size", size, f"a positive multiple of "
                               f"moe_intermediate_size ({width}): model.moe.shared_experts of that width")
        shared, shared_gate = size // width, True
    return MoeConfig(experts=experts, top_k=top_k, mlp_dim=width, shared_experts=shared, shared_gate=shared_gate,
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)), every=int(hf.get("decoder_sparse_step", 1)),
                     first=len(dense), aux_loss_weight=aux)


def _gpt2_config(hf: dict[str, Any], src: Path, common: dict[str, Any]) -> ModelConfig:
    require(hf, src, {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False})
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise unsupported(src, "activation_function", hf["activation_function"], "gelu_new (GELU, tanh approximation)")
    d = hf["n_embd"]
    return ModelConfig(
        **common, family="gpt2", d_model=d, layers=hf["n_layer"], heads=hf["n_head"], mlp_dim=hf.get("n_inner") or 4 * d,
        max_seq_len=hf["n_positions"], norm_eps=hf["layer_norm_epsilon"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _sliding_window(hf: dict[str, Any], src: Path, model_type: str) -> tuple[int, tuple[str, ...]]:
    """(model.sliding_window, model.layer_types): Mistral's window applies to every layer; Qwen's (with
    use_sliding_window) to the layers from max_window_layers on, or to those `layer_types` marks sliding."""
    if model_type in ("mistral", "mixtral", "phi3"):
        return int(hf.get("sliding_window") or 0), ()
    if model_type == "qwen3_moe":  # one switch for every layer
        return (int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window", False) else 0), ()
    if model_type == "smollm3":  # the window on the layers layer_types marks sliding (transformers: the NoPE ones)
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        flags = hf.get("no_rope_layers") or []
        types = hf.get("layer_types") or ["sliding_attention" if window is not None and i < len(flags) and not
                                          flags[i] else "full_attention" for i in range(hf["num_hidden_layers"])]
        return _layer_kinds(hf, src, types, window)
    if model_type not in ("qwen2", "qwen3", "qwen2_moe"):
        return 0, ()  # transformers' Llama has no sliding window
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(hf["num_hidden_layers"])]
    return _layer_kinds(hf, src, types, window)


def hf_config(cfg: ModelConfig, vocab: int, token_ids: dict[str, Any]) -> dict[str, Any]:
    """config.json for `cfg` with `vocab` embedding rows and the special `token_ids` (bos/eos/pad_token_id)."""
    model_type = architecture(cfg)
    common = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": vocab,
              "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32", **token_ids}
    if model_type == "gpt2":
        return _gpt2_json(cfg, common)
    if model_type in GEMMA_TYPES:
        return _gemma_json(cfg, model_type, common)
    if model_type == "gpt_oss":
        return _gpt_oss_json(cfg, common)
    if model_type == deepseek.MODEL_TYPE:
        return deepseek.config_json(cfg, common)
    rope = rope_to_hf(cfg)
    out = {
        **common, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
    }
    if cfg.rope_scaling.type != "none":
        out["rope_scaling"] = rope  # what transformers 4.x reads (with the top-level rope_theta); 5 reads either
    if model_type in MOE_TYPES:
        out.update(_moe_json(cfg, model_type))
    if model_type in families.FAMILY_TYPES:
        return families.config_json(cfg, model_type, out)
    if model_type == "llama":
        return {**out, "attention_bias": False, "mlp_bias": False}
    if model_type in ("mistral", "mixtral"):
        return {**out, "sliding_window": cfg.sliding_window or None}
    window = cfg.sliding_window or None
    if model_type == "qwen3_moe":
        return {**out, "attention_bias": False, "use_sliding_window": window is not None, "sliding_window": window}
    # Qwen2, Qwen3, Qwen2-MoE: the window on the layers that layer_types marks sliding (max_window_layers: the
    # full layers before the first sliding one, what transformers derives layer_types from when it is absent).
    local = cfg.local_layers
    window = window if any(local) else None
    out.update(use_sliding_window=window is not None, sliding_window=window,
               max_window_layers=local.index(True) if window else cfg.layers,
               layer_types=["sliding_attention" if is_local and window else "full_attention" for is_local in local])
    return {**out, "attention_bias": False} if model_type == "qwen3" else out


def _gemma_json(cfg: ModelConfig, model_type: str, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of a Gemma, Gemma 2 or Gemma 3 (text) that computes `cfg` (`_gemma_architecture` checked it)."""
    out = {**common, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.layers,
           "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "attention_bias": False}
    rope = {**rope_to_hf(cfg), "rope_theta": cfg.rope_theta}
    if model_type == "gemma":
        return {**out, "hidden_act": "gelu_pytorch_tanh", "rope_theta": cfg.rope_theta, "rope_parameters": rope}
    local = cfg.local_layers
    out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=_query_pre_attn_scalar(cfg),
               final_logit_softcapping=cfg.final_logit_softcap or None, sliding_window=cfg.sliding_window or None,
               layer_types=["sliding_attention" if is_local else "full_attention" for is_local in local])
    if model_type == "gemma2":
        return {**out, "attn_logit_softcapping": cfg.attn_logit_softcap or None, "rope_parameters": rope}
    sliding = {"rope_type": "default", "rope_theta": cfg.rope_local_theta} if cfg.rope_local_theta else rope
    return {**out, "attn_logit_softcapping": None,
            "rope_parameters": {"full_attention": rope, "sliding_attention": sliding}}


def _gpt_oss_json(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of a GPT-OSS that computes `cfg` (`_gpt_oss_architecture` checked it); float32 experts, so no
    quantization_config."""
    moe, rope = cfg.moe, rope_to_hf(cfg)
    out = {**common, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_expert, "num_hidden_layers": cfg.layers,
           "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "attention_bias": cfg.qkv_bias,
           "rope_theta": cfg.rope_theta, "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
           "sliding_window": cfg.sliding_window or None, "num_local_experts": moe.experts,
           "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_weight / moe.top_k,
           "swiglu_alpha": moe.swiglu_alpha, "swiglu_limit": moe.swiglu_limit,
           "layer_types": ["sliding_attention" if local and cfg.sliding_window else "full_attention"
                           for local in cfg.local_layers]}
    return {**out, "rope_scaling": rope} if cfg.rope_scaling.type != "none" else out


def _gpt_oss_architecture(cfg: ModelConfig) -> str:
    """gpt_oss when this run computes what GptOssForCausalLM does; a UserError naming what differs."""
    moe = cfg.moe
    wanted = {"model.attn_sinks": (cfg.attn_sinks, True), "model.attn_out_bias": (cfg.attn_out_bias, cfg.qkv_bias),
              "model.qk_norm": (cfg.qk_norm, False), "model.moe.experts > 0": (moe.experts > 0, True),
              "model.moe.every": (moe.every, 1), "model.moe.first": (moe.first, 0),
              "model.moe.norm_topk_prob": (moe.norm_topk_prob, True), "model.moe.router_bias": (moe.router_bias, True),
              "model.moe.expert_bias": (moe.expert_bias, True), "model.moe.swiglu_limit > 0": (moe.swiglu_limit > 0, True),
              "model.moe.shared_experts": (moe.shared_experts, 0), "model.rope_local_theta": (cfg.rope_local_theta, 0.0)}
    problems = [f"{key}={got} (GPT-OSS: {want})" for key, (got, want) in wanted.items() if got != want]
    if problems:
        raise UserError(
            f"This run has GPT-OSS's switches (attention sinks, an output-projection bias or its experts' biases and "
            f"clamped SwiGLU) but does not match GptOssForCausalLM: {'; '.join(problems)}. GPT-OSS has sinks, biases "
            "on q, k, v and o together, and in every layer experts with a router bias, expert biases and the clamped "
            "SwiGLU. Fix: only runs that one Hugging Face architecture computes can be exported."
        )
    return "gpt_oss"


def _query_pre_attn_scalar(cfg: ModelConfig) -> int:
    """Gemma 2/3's query_pre_attn_scalar s, whose 1/sqrt(s) scales the logits: the head size by default."""
    if not cfg.attn_logit_scale:
        return cfg.d_head
    scalar = round(cfg.attn_logit_scale**-2)
    if scalar < 1 or scalar**-0.5 != cfg.attn_logit_scale:
        raise UserError(
            f"model.attn_logit_scale={cfg.attn_logit_scale} is not 1/sqrt(s) of a whole number s, but Gemma 2 and 3 "
            "scale the attention logits by query_pre_attn_scalar**-0.5 with an integer query_pre_attn_scalar. Fix: "
            f"only runs with such a scale (e.g. model.attn_logit_scale={256**-0.5} for 256) export as Gemma."
        )
    return scalar


def _moe_json(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    moe = cfg.moe
    common = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_weight / moe.top_k}
    if model_type == "mixtral":  # every layer MoE, intermediate_size the experts' width
        return {**common, "num_local_experts": moe.experts, "intermediate_size": cfg.d_expert,
                "router_jitter_noise": 0.0}
    out = {**common, "num_experts": moe.experts, "moe_intermediate_size": cfg.d_expert, "intermediate_size": cfg.d_mlp,
           "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": moe.every,
           "mlp_only_layers": list(range(moe.first))}
    if model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=moe.shared_experts * cfg.d_expert, qkv_bias=True)
    return out


def architecture(cfg: ModelConfig) -> str:
    """The Hugging Face model_type that computes what `cfg` does."""
    if cfg.family == "gpt2":
        return "gpt2"
    if cfg.mla.kv_lora_rank or cfg.moe.scoring == "sigmoid":
        deepseek.check(cfg)
        return deepseek.MODEL_TYPE
    family = families.architecture(cfg)
    if family:
        return family
    if hf_gemma(cfg):
        return _gemma_architecture(cfg)
    if hf_gpt_oss(cfg):
        return _gpt_oss_architecture(cfg)
    gemma_only = {"model.attn_logit_scale": cfg.attn_logit_scale, "model.attn_logit_softcap": cfg.attn_logit_softcap,
                  "model.final_logit_softcap": cfg.final_logit_softcap, "model.rope_local_theta": cfg.rope_local_theta}
    if any(gemma_only.values()):
        raise UserError(
            f"This run sets {', '.join(f'{k}={v}' for k, v in gemma_only.items() if v)} without Gemma's GeGLU "
            "(model.mlp_activation=gelu_tanh) and embedding scale (model.embed_multiplier=sqrt(d_model)); only the "
            "Gemma architectures compute these, and with those. Fix: only runs that one Hugging Face architecture "
            "computes can be exported (the families in docs/porting-from-pytorch.md)."
        )
    if cfg.qk_norm and cfg.qkv_bias:
        raise UserError(
            "This run has both model.qk_norm and model.qkv_bias. Hugging Face's Qwen3 (q/k norms) has biases only "
            "with attention_bias, which also puts one on the output projection, and Qwen2 (q/k/v biases) has no q/k "
            "norms: no architecture computes this model. Fix: only runs with one of the two can be exported."
        )
    if cfg.moe.experts:
        model_type = _moe_architecture(cfg)
        if len(set(cfg.local_layers)) > 1 and model_type != "qwen2_moe":
            raise UserError(
                f"This MoE run has model.layer_types={list(cfg.layer_types)} (sliding and full layers), but it "
                f"exports as {ARCHITECTURES[model_type]}, whose window covers every layer or none. Fix: only runs "
                "that one Hugging Face architecture computes can be exported (per-layer windows: Qwen2-MoE)."
            )
        return model_type
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    if len(set(cfg.local_layers)) > 1:
        raise UserError(
            f"This run has model.layer_types={list(cfg.layer_types)}: sliding and full layers, without q/k/v biases "
            "or q/k norms. Hugging Face's Mistral puts the window on every layer; per-layer windows come with Qwen2 "
            "(q/k/v biases), Qwen3 (q/k norms) and Gemma 2/3. Fix: only runs that one of them computes can be exported."
        )
    return "mistral" if cfg.sliding_window else "llama"


def _gemma_architecture(cfg: ModelConfig) -> str:
    """Gemma, Gemma 2 or Gemma 3 (text), whichever computes this run; a UserError naming what fits none."""
    d = cfg.d_model
    problems = []
    if np.float32(cfg.embed_multiplier) != np.float32(d**0.5):
        problems.append(f"model.embed_multiplier={cfg.embed_multiplier} (Gemma: sqrt(d_model) = {d**0.5:.6g})")
    if cfg.mlp_activation != "gelu_tanh":
        problems.append(f"model.mlp_activation={cfg.mlp_activation} (Gemma: gelu_tanh)")
    if cfg.qkv_bias or cfg.moe.experts:
        problems.append("q/k/v biases or experts (Gemma has neither)")
    sandwich = cfg.norm_placement == "sandwich"
    model_type = ("gemma3_text" if cfg.qk_norm else "gemma2") if sandwich else "gemma"
    if model_type == "gemma":
        gemma2_only = {"model.qk_norm": cfg.qk_norm, "model.sliding_window": cfg.sliding_window,
                       "model.attn_logit_scale": cfg.attn_logit_scale and cfg.attn_logit_scale != cfg.d_head**-0.5,
                       "model.attn_logit_softcap": cfg.attn_logit_softcap,
                       "model.final_logit_softcap": cfg.final_logit_softcap,
                       "model.rope_local_theta": cfg.rope_local_theta}
        problems += [f"{k} without model.norm_placement=sandwich (Gemma 2/3)" for k, v in gemma2_only.items() if v]
    elif model_type == "gemma2" and cfg.rope_local_theta:
        problems.append("model.rope_local_theta without q/k norms (Gemma 3 has both; Gemma 2 neither)")
    elif model_type == "gemma3_text" and cfg.attn_logit_softcap:
        problems.append("model.attn_logit_softcap with q/k norms (transformers' Gemma 3 does not soft-cap attention)")
    if problems:
        raise UserError(
            f"This run has Gemma's switches but matches no Gemma architecture: {'; '.join(problems)}. Gemma has GeGLU "
            "and embeddings times sqrt(d_model); Gemma 2 adds sandwich norms, logit soft-caps and sliding layers; "
            "Gemma 3 has q/k norms instead of the attention soft-cap and its own RoPE base on the sliding layers. Fix: "
            "only runs that one of them computes can be exported."
        )
    return model_type


def _moe_architecture(cfg: ModelConfig) -> str:
    """Mixtral, Qwen2-MoE or Qwen3-MoE, whichever computes this mixture of experts; a UserError naming what does
    not fit any of them."""
    moe = cfg.moe
    if hf_mixtral(cfg):
        if moe.norm_topk_prob and moe.every == 1 and moe.first == 0:
            return "mixtral"
        problem = "Mixtral (no q/k norms, biases or shared experts) renormalises the top-k weights in every layer"
    elif cfg.qk_norm and not moe.shared_experts:
        return "qwen3_moe"
    elif cfg.qkv_bias and moe.shared_experts and moe.shared_gate:
        return "qwen2_moe"
    else:
        problem = ("Qwen3-MoE has q/k norms and no shared experts; Qwen2-MoE has q/k/v biases and a gated shared "
                   "expert")
    raise UserError(
        f"This MoE run (model.qk_norm={cfg.qk_norm}, model.qkv_bias={cfg.qkv_bias}, model.moe.shared_experts="
        f"{moe.shared_experts}, shared_gate={moe.shared_gate}, norm_topk_prob={moe.norm_topk_prob}, every={moe.every}, "
        f"first={moe.first}, model.sliding_window={cfg.sliding_window}) matches no Hugging Face architecture: "
        f"{problem}. Fix: only runs that one of Mixtral, Qwen2-MoE and Qwen3-MoE computes can be exported."
    )


def _gpt2_json(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    if cfg.n_kv_heads != cfg.heads or cfg.d_head * cfg.heads != cfg.d_model or cfg.sliding_window:
        raise UserError(
            f"This gpt2-family run has model.kv_heads={cfg.n_kv_heads}, head size {cfg.d_head} and "
            f"model.sliding_window={cfg.sliding_window} with model.heads={cfg.heads}, model.d_model={cfg.d_model}; "
            "Hugging Face's GPT-2 has neither grouped-query attention, a separate head size nor a sliding window "
            "(kv_heads = heads, head size = d_model / heads, window 0). Fix: only runs with those defaults can be "
            "exported as GPT2LMHeadModel."
        )
    return {
        **common, "n_embd": cfg.d_model, "n_layer": cfg.layers, "n_head": cfg.heads, "n_inner": cfg.d_mlp,
        "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
        # systolic trains without dropout; HF's GPT-2 defaults to 0.1, which would change a fine-tune there.
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
    }


def _model_type(hf: dict[str, Any], src: Path) -> str:
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list):
        architectures = [architectures]
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES or (architectures and ARCHITECTURES[model_type] not in architectures):
        supported = ", ".join(f"{a} (model_type {t})" for t, a in ARCHITECTURES.items())
        raise UserError(
            f"{src}/config.json describes model_type {model_type!r} with architectures {architectures}, which "
            f"systolic does not convert. It converts {supported}; {SUPPORTED_LIST} lists them with the settings each "
            "accepts. Fix: pass a checkpoint of one of these families (a fine-tune keeps its base model's "
            "model_type and architectures, so one of a listed family converts); a model of another architecture "
            "cannot be imported into systolic."
        )
    return model_type


