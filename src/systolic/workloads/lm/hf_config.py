"""Hugging Face `config.json` (LlamaConfig, GPT2Config) <-> the lm workload's `ModelConfig`.

Only what the systolic model computes is accepted: a setting that would change the math (RoPE scaling, biases
in Llama, an exact-erf GELU in GPT-2) is an error here rather than a silently different model after import.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from systolic.errors import UserError
from systolic.workloads.lm.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


def read_config(src: Path) -> dict[str, Any]:
    path = Path(src) / "config.json"
    if not path.is_file():
        raise UserError(
            f"{src} has no config.json, so it is not a Hugging Face model folder. Expected a local folder with "
            "config.json and model.safetensors (or model-*.safetensors with model.safetensors.index.json), as "
            "`save_pretrained` or `huggingface-cli download` writes it. Fix: pass such a folder."
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"Cannot read {path} as JSON ({e}). Fix: restore the file from the model's source.") from None


def model_config(hf: dict[str, Any], src: Path, *, scan_layers: bool = False) -> ModelConfig:
    """Our ModelConfig for a Llama or GPT-2 config.json; the vocabulary is exactly HF's `vocab_size`."""
    family = _family(hf, src)
    try:
        return _model_config(hf, src, family, scan_layers)
    except KeyError as e:
        raise UserError(
            f"{src}/config.json has no {e.args[0]!r}, which a {ARCHITECTURES[family]} config needs. Fix: restore "
            "the file from the model's source (transformers' save_pretrained writes every key)."
        ) from None


def _model_config(hf: dict[str, Any], src: Path, family: str, scan_layers: bool) -> ModelConfig:
    vocab = int(hf["vocab_size"])
    # vocab_multiple divides vocab, so the padded vocabulary is vocab itself: no extra logit rows.
    common = dict(family=family, vocab_size=vocab, vocab_multiple=math.gcd(vocab, 64), scan_layers=scan_layers)
    if family == "llama":
        _require(hf, src, {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False})
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or d // heads
        return ModelConfig(
            **common, d_model=d, layers=hf["num_hidden_layers"], heads=heads,
            kv_heads=hf.get("num_key_value_heads") or heads, head_dim=0 if head_dim == d // heads else head_dim,
            mlp_dim=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"], rope_theta=_rope_theta(hf, src),
            norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    _require(hf, src, {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False})
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _unsupported(src, "activation_function", hf["activation_function"], "gelu_new (GELU, tanh approximation)")
    d = hf["n_embd"]
    return ModelConfig(
        **common, d_model=d, layers=hf["n_layer"], heads=hf["n_head"], mlp_dim=hf.get("n_inner") or 4 * d,
        max_seq_len=hf["n_positions"], norm_eps=hf["layer_norm_epsilon"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def hf_config(cfg: ModelConfig, vocab: int, eos_id: int | None) -> dict[str, Any]:
    """config.json for `cfg` with `vocab` embedding rows; `eos_id` is the tokenizer's end-of-text id."""
    special = {"bos_token_id": eos_id, "eos_token_id": eos_id} if eos_id is not None else {}
    common = {"architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family, "vocab_size": vocab,
              "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32", **special}
    if cfg.family == "llama":
        return {
            **common, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False, "mlp_bias": False,
        }
    if cfg.n_kv_heads != cfg.heads or cfg.d_head * cfg.heads != cfg.d_model:
        raise UserError(
            f"This gpt2-family run has model.kv_heads={cfg.n_kv_heads} and head size {cfg.d_head} with "
            f"model.heads={cfg.heads}, model.d_model={cfg.d_model}; Hugging Face's GPT-2 has neither grouped-query "
            "attention nor a separate head size (kv_heads = heads, head size = d_model / heads). Fix: only runs "
            "with those defaults can be exported as GPT2LMHeadModel."
        )
    return {
        **common, "n_embd": cfg.d_model, "n_layer": cfg.layers, "n_head": cfg.heads, "n_inner": cfg.d_mlp,
        "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
        # systolic trains without dropout; HF's GPT-2 defaults to 0.1, which would change a fine-tune there.
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
    }


def _family(hf: dict[str, Any], src: Path) -> str:
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    family = model_type if model_type in ARCHITECTURES else None
    if family is None or (architectures and ARCHITECTURES[family] not in architectures):
        supported = ", ".join(f"{a} (model_type {f})" for f, a in ARCHITECTURES.items())
        raise UserError(
            f"{src}/config.json describes model_type {model_type!r} with architectures {architectures}, which "
            f"systolic cannot convert. Supported: {supported}. Fix: pass a Llama or GPT-2 checkpoint; other "
            "architectures need their own mapping in systolic.workloads.lm.hf."
        )
    return family


def _rope_theta(hf: dict[str, Any], src: Path) -> float:
    # transformers 5 writes `rope_parameters`; older configs `rope_theta` plus an optional `rope_scaling`.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise _unsupported(src, "rope scaling", rope, "plain RoPE (rope_type 'default', no rope_scaling)")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _require(hf: dict[str, Any], src: Path, expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        if key in hf and hf[key] != value:
            raise _unsupported(src, key, hf[key], repr(value))


def _unsupported(src: Path, what: str, got: Any, expected: str) -> UserError:
    return UserError(
        f"{src}/config.json sets {what} = {got!r}, which the systolic model does not compute (expected {expected}); "
        "converting would give a different model. Fix: pass a checkpoint without this setting."
    )
