"""The tensor map between the lm model's parameters and Hugging Face's tensors: Llama (and Qwen2, Qwen3, Mistral
and the Gemmas, which name them alike and add q/k/v biases, q/k norms or Gemma 2/3's sandwich norms), the mixtures
of experts Mixtral, Qwen2-MoE and Qwen3-MoE (the same attention; each expert's matrices are separate HF tensors,
one slice of our stacked (E, ...) weights), GPT-OSS (q/k/v/o biases, sinks; its experts are one HF tensor each
for all experts, in our (E, in, out) layout, the gate and up projections interleaved column by column in one
gate_up_proj), DeepSeek-V3 (multi-head latent attention, DeepSeek's router), Phi-3 (Llama's tensors with q, k and v
fused into one `qkv_proj` and gate and up into one `gate_up_proj`: each of ours is a slice of the fused tensor's
rows), OLMo 2 (norms after the sublayers only, q/k norms over all heads) and GPT-2.

Each `Tensor` entry names one of our parameters, its HF tensor and the layout change between them; `to_ours`
and `to_hf` apply it in either direction, so import and export read the same table. Our RoPE uses HF's
rotate-half layout, so q/k projections need reshapes only, no permutation of rows. Gemma's RMSNorm multiplies by
(1 + w) and stores w: our scale is 1 + w (`Tensor.offset`), added in float32 as transformers adds it at run time, so
the norm computes the same numbers, and w = scale - 1 on export gives back a tensor whose 1 + w is our scale exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from systolic.workloads.lm.model.config import ModelConfig

KeyPath = tuple[Any, ...]  # a key path into the params pure dict, e.g. ("blocks", 0, "attn", "wq")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter of ours <-> (a part of) one HF tensor.

    Import: take part `part[0]` of `part[1]` slices of the HF tensor's output axis (the first of a torch Linear's
    (out, in), the last of GPT-2's Conv1D (in, out)), equal or of `sizes`, transpose when HF stores the matrix
    (out, in) (torch Linear), reshape to our shape. Export is the inverse: our axes [:in_axes] become the HF matrix's
    rows and the rest its columns (in_axes None: a vector), the parts joined along the output axis.
    """

    ours: tuple[str, ...]
    hf: str
    transpose: bool = False
    in_axes: int | None = 1
    part: tuple[int, int] = (0, 1)
    per_expert: bool = False  # one HF tensor per expert ("{j}" in `hf`): expert j's slice of our (E, ...) weight
    offset: float = 0.0  # ours = HF's + offset (Gemma's norms: 1)
    stacked: bool = False  # the HF tensor has our (E, ...) shape as it is (GPT-OSS's experts): no 2-D flattening
    interleave: bool = False  # the parts alternate along the last axis (part k: columns k, k + parts, ...)
    sizes: tuple[int, ...] = ()  # unequal parts: every part's length along the output axis (Phi-3's q, k, v)

    @property
    def out_axis(self) -> int:
        """The HF tensor's output axis, along which the parts of a fused tensor sit."""
        return 0 if self.transpose and self.in_axes is not None else -1


def _vector(ours: tuple[str, ...], hf: str, **kw: Any) -> Tensor:
    return Tensor(ours, hf, in_axes=None, **kw)


def _llama(cfg: ModelConfig, model_type: str) -> tuple[list[Tensor], Callable[[int], list[Tensor]], str]:
    """(top-level tensors, each layer's tensors, per-layer name prefix) of LlamaForCausalLM, and of Qwen2ForCausalLM
    (+ q/k/v biases), Qwen3ForCausalLM (+ q/k norms), MistralForCausalLM, and with model.moe of MixtralForCausalLM,
    Qwen2MoeForCausalLM (+ a gated shared expert) and Qwen3MoeForCausalLM in their MoE layers; Phi-3's fused
    projections when `model_type` is phi3, OLMo 2's norms with norm_placement=post."""
    norm = lambda ours, hf: _vector(ours, hf, offset=1.0 if hf_gemma(cfg) else 0.0)  # noqa: E731
    top = [Tensor(("embed",), "model.embed_tokens.weight"), norm(("final_norm", "scale"), "model.norm.weight")]
    if not cfg.tie_embeddings:
        top.append(Tensor(("lm_head",), "lm_head.weight", transpose=True))  # (V, D) -> (D, V)
    if cfg.norm_placement == "sandwich":  # Gemma 2/3: post_attention_layernorm is the attention's output norm
        mlp_norms = [norm(("attn_post_norm", "scale"), "post_attention_layernorm.weight"),
                     norm(("mlp_norm", "scale"), "pre_feedforward_layernorm.weight"),
                     norm(("mlp_post_norm", "scale"), "post_feedforward_layernorm.weight")]
    elif cfg.norm_placement == "post":  # OLMo 2: the sublayers' outputs normed, their inputs not
        mlp_norms = [norm(("attn_post_norm", "scale"), "post_attention_layernorm.weight"),
                     norm(("mlp_post_norm", "scale"), "post_feedforward_layernorm.weight")]
    else:
        mlp_norms = [norm(("mlp_norm", "scale"), "post_attention_layernorm.weight")]
    attention = [
        *([norm(("attn_norm", "scale"), "input_layernorm.weight")] if cfg.norm_placement != "post" else []),
        *_projections(cfg, model_type),
        *([_vector(("attn", f"b{w}"), f"self_attn.{w}_proj.bias") for w in "qkv"] if cfg.qkv_bias else []),  # (N*hd,) -> (N, hd)
        *([norm(("attn", f"{w}_norm", "scale"), f"self_attn.{w}_norm.weight") for w in "qk"]
          if cfg.qk_norm else []),  # (hd,), or (N*hd,) -> (N, hd) over all heads (OLMo 2)
        Tensor(("attn", "wo"), "self_attn.o_proj.weight", transpose=True, in_axes=2),  # (D, H*hd) -> (H, hd, D)
        *mlp_norms,
    ]
    if model_type == "phi3":  # gate_up_proj (2M, D): the gate's rows, then up's
        gate_up = [Tensor(("mlp", w), "mlp.gate_up_proj.weight", transpose=True, part=(k, 2))  # -> (D, M) each
                   for k, w in enumerate(("w_gate", "w_up"))]
    else:
        gate_up = [Tensor(("mlp", "w_gate"), "mlp.gate_proj.weight", transpose=True),  # (M, D) -> (D, M)
                   Tensor(("mlp", "w_up"), "mlp.up_proj.weight", transpose=True)]  # (M, D) -> (D, M)
    dense = [*gate_up, Tensor(("mlp", "w_down"), "mlp.down_proj.weight", transpose=True)]  # (D, M) -> (M, D)
    moe = _moe_tensors(cfg) if cfg.moe.experts else []
    return top, lambda i: attention + (moe if cfg.moe.is_moe_layer(i) else dense), "model.layers.{i}."


def _projections(cfg: ModelConfig, model_type: str) -> list[Tensor]:
    """The q, k and v projections: Llama's three tensors, or Phi-3's qkv_proj (H*hd + 2*KV*hd, D) holding q's rows,
    then k's, then v's."""
    names = ("wq", "wk", "wv")
    if model_type == "phi3":
        sizes = tuple(n * cfg.d_head for n in (cfg.heads, cfg.n_kv_heads, cfg.n_kv_heads))
        return [Tensor(("attn", w), "self_attn.qkv_proj.weight", transpose=True, part=(k, 3), sizes=sizes)
                for k, w in enumerate(names)]  # -> (D, H, hd), (D, KV, hd), (D, KV, hd)
    return [Tensor(("attn", w), f"self_attn.{w[1]}_proj.weight", transpose=True)  # (N*hd, D) -> (D, N, hd)
            for w in names]


def _moe_tensors(cfg: ModelConfig) -> list[Tensor]:
    """A MoE layer's MLP tensors: Mixtral's block_sparse_moe (w1 gate, w3 up, w2 down), else Qwen-MoE's mlp."""
    expert = lambda ours, hf: Tensor(("mlp", ours), hf, transpose=True, per_expert=True)  # noqa: E731
    if hf_mixtral(cfg):
        return [Tensor(("mlp", "router"), "block_sparse_moe.gate.weight", transpose=True),  # (E, D) -> (D, E)
                expert("w_gate", "block_sparse_moe.experts.{j}.w1.weight"),  # (M, D) -> (D, M) of (E, D, M)
                expert("w_up", "block_sparse_moe.experts.{j}.w3.weight"),  # (M, D) -> (D, M) of (E, D, M)
                expert("w_down", "block_sparse_moe.experts.{j}.w2.weight")]  # (D, M) -> (M, D) of (E, M, D)
    out = [Tensor(("mlp", "router"), "mlp.gate.weight", transpose=True),  # (E, D) -> (D, E)
           *(expert(f"w_{w}", f"mlp.experts.{{j}}.{w}_proj.weight") for w in ("gate", "up", "down"))]
    if cfg.moe.shared_experts:  # (S*M, D) -> (D, S*M), down (D, S*M) -> (S*M, D)
        out += [Tensor(("mlp", "shared", f"w_{w}"), f"mlp.shared_expert.{w}_proj.weight", transpose=True)
                for w in ("gate", "up", "down")]
    if cfg.moe.shared_gate:
        out.append(Tensor(("mlp", "shared_gate"), "mlp.shared_expert_gate.weight", transpose=True))  # (1, D) -> (D, 1)
    return out


def _gpt_oss(cfg: ModelConfig) -> tuple[list[Tensor], Callable[[int], list[Tensor]], str]:
    """(top-level tensors, each layer's tensors, per-layer name prefix) of GptOssForCausalLM: Llama's names plus
    the attention's biases and sinks, and its MLP in every layer: a router with a bias and the experts stacked,
    gate_up_proj (E, D, 2M) holding the gate's columns at even and the up projection's at odd indices."""
    top, llama_layer, prefix = _llama(cfg, "gpt_oss")
    stacked = lambda ours, hf, **kw: Tensor(("mlp", ours), f"mlp.experts.{hf}", stacked=True, **kw)  # noqa: E731
    layer = [t for t in llama_layer(0) if t.ours[0] != "mlp"] + [
        *([_vector(("attn", "bo"), "self_attn.o_proj.bias")] if cfg.attn_out_bias else []),  # (D,)
        _vector(("attn", "sinks"), "self_attn.sinks"),  # (H,)
        Tensor(("mlp", "router"), "mlp.router.weight", transpose=True),  # (E, D) -> (D, E)
        _vector(("mlp", "router_bias"), "mlp.router.bias"),  # (E,)
        stacked("w_gate", "gate_up_proj", part=(0, 2), interleave=True),  # (E, D, 2M) -> (E, D, M)
        stacked("w_up", "gate_up_proj", part=(1, 2), interleave=True),
        stacked("b_gate", "gate_up_proj_bias", part=(0, 2), interleave=True),  # (E, 2M) -> (E, M)
        stacked("b_up", "gate_up_proj_bias", part=(1, 2), interleave=True),
        stacked("w_down", "down_proj"),  # (E, M, D)
        stacked("b_down", "down_proj_bias"),  # (E, D)
    ]
    return top, lambda i: layer, prefix


def hf_gpt_oss(cfg: ModelConfig) -> bool:
    """Whether the model exports as GPT-OSS (hf_config.architecture checks the rest): sinks or GPT-OSS's experts."""
    return cfg.attn_sinks or cfg.attn_out_bias or cfg.moe.swiglu_limit > 0 or cfg.moe.expert_bias or cfg.moe.router_bias


def _deepseek(cfg: ModelConfig) -> tuple[list[Tensor], Callable[[int], list[Tensor]], str]:
    """(top-level tensors, each layer's tensors, per-layer name prefix) of DeepseekV3ForCausalLM: Llama's embeddings
    and norms, multi-head latent attention (lm/model/mla.py), and from layer model.moe.first on DeepSeek's experts
    (a router with its score correction bias, shared experts); the layers before keep Llama's dense MLP."""
    dense_cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, experts=0))
    top, llama_layer, prefix = _llama(dense_cfg, "deepseek_v3")
    dense = [t for t in llama_layer(0) if t.ours[0] in ("attn_norm", "mlp_norm", "mlp")]
    if cfg.mla.q_lora_rank:  # (rq, D) -> (D, rq); norm (rq,); (H*qk, rq) -> (rq, H, qk)
        queries = [Tensor(("attn", "wq_a"), "self_attn.q_a_proj.weight", transpose=True),
                   _vector(("attn", "q_norm", "scale"), "self_attn.q_a_layernorm.weight"),
                   Tensor(("attn", "wq_b"), "self_attn.q_b_proj.weight", transpose=True)]
    else:
        queries = [Tensor(("attn", "wq"), "self_attn.q_proj.weight", transpose=True)]  # (H*qk, D) -> (D, H, qk)
    attention = [
        *queries,
        Tensor(("attn", "wkv_a"), "self_attn.kv_a_proj_with_mqa.weight", transpose=True),  # (r+rope, D) -> (D, r+rope)
        _vector(("attn", "kv_norm", "scale"), "self_attn.kv_a_layernorm.weight"),  # (r,)
        Tensor(("attn", "wkv_b"), "self_attn.kv_b_proj.weight", transpose=True),  # (H*(nope+v), r) -> (r, H, nope+v)
        Tensor(("attn", "wo"), "self_attn.o_proj.weight", transpose=True, in_axes=2),  # (D, H*v) -> (H, v, D)
    ]
    expert = lambda ours, hf: Tensor(("mlp", ours), hf, transpose=True, per_expert=True)  # noqa: E731
    moe = [Tensor(("mlp", "router"), "mlp.gate.weight", transpose=True),  # (E, D) -> (D, E)
           _vector(("mlp", "score_correction"), "mlp.gate.e_score_correction_bias"),  # (E,)
           *(expert(f"w_{w}", f"mlp.experts.{{j}}.{w}_proj.weight") for w in ("gate", "up", "down")),
           *(Tensor(("mlp", "shared", f"w_{w}"), f"mlp.shared_experts.{w}_proj.weight", transpose=True)
             for w in ("gate", "up", "down"))]  # (S*M, D) -> (D, S*M), down (D, S*M) -> (S*M, D)
    norms, dense_mlp = dense[:2], dense[2:]
    return top, lambda i: norms + attention + (moe if cfg.moe.is_moe_layer(i) else dense_mlp), prefix


def hf_gemma(cfg: ModelConfig) -> bool:
    """Whether the model exports as one of the Gemmas (hf_config.architecture says which), whose norms store w =
    scale - 1: Gemma's GeGLU or sandwich norms, which no other architecture here has (Granite scales its embeddings
    too, with SwiGLU and pre-norms)."""
    return cfg.mlp_activation != "silu" or cfg.norm_placement == "sandwich"


def hf_mixtral(cfg: ModelConfig) -> bool:
    """Whether a MoE model is Mixtral's kind (hf_config.architecture says which; Qwen-MoE otherwise)."""
    return not (cfg.qk_norm or cfg.qkv_bias or cfg.moe.shared_experts)


def _gpt2(cfg: ModelConfig) -> tuple[list[Tensor], Callable[[int], list[Tensor]], str]:
    """(top-level tensors, per-layer tensors, per-layer name prefix) of GPT2LMHeadModel. Its Conv1D stores
    (in, out): no transposes. c_attn's output is q, k and v side by side, each (H, hd)."""
    top = [
        Tensor(("embed",), "transformer.wte.weight"), Tensor(("pos_embed",), "transformer.wpe.weight"),
        _vector(("final_norm", "scale"), "transformer.ln_f.weight"), _vector(("final_norm", "bias"), "transformer.ln_f.bias"),
    ]
    if not cfg.tie_embeddings:
        top.append(Tensor(("lm_head",), "lm_head.weight", transpose=True))  # (V, D) -> (D, V)
    layer = [
        _vector(("attn_norm", "scale"), "ln_1.weight"), _vector(("attn_norm", "bias"), "ln_1.bias"),
        *(Tensor(("attn", w), "attn.c_attn.weight", part=(k, 3)) for k, w in enumerate(("wq", "wk", "wv"))),  # (D, 3D) -> 3 x (D, H, hd)
        *(_vector(("attn", b), "attn.c_attn.bias", part=(k, 3)) for k, b in enumerate(("bq", "bk", "bv"))),  # (3D,) -> 3 x (H, hd)
        Tensor(("attn", "wo"), "attn.c_proj.weight", in_axes=2),  # (H*hd, D) -> (H, hd, D)
        _vector(("attn", "bo"), "attn.c_proj.bias"),
        _vector(("mlp_norm", "scale"), "ln_2.weight"), _vector(("mlp_norm", "bias"), "ln_2.bias"),
        Tensor(("mlp", "w_fc"), "mlp.c_fc.weight"), _vector(("mlp", "b_fc"), "mlp.c_fc.bias"),  # (D, M), (M,)
        Tensor(("mlp", "w_proj"), "mlp.c_proj.weight"), _vector(("mlp", "b_proj"), "mlp.c_proj.bias"),  # (M, D), (D,)
    ]
    return top, lambda i: layer, "transformer.h.{i}."


@dataclasses.dataclass(frozen=True)
class Pair:
    """`hf` (a full HF tensor name) holds `tensor` of our parameter at `path`; `layer` indexes the leading axis
    of a stacked (scan_layers) parameter, `expert` the experts axis after it, each None when absent."""

    hf: str
    path: KeyPath
    layer: int | None
    tensor: Tensor
    expert: int | None = None

    @property
    def index(self) -> tuple[int, ...]:
        """Where the HF tensor sits in our parameter: (), (layer,), (expert,) or (layer, expert)."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def pairs(cfg: ModelConfig, model_type: str = "") -> list[Pair]:
    """Every (HF tensor, our parameter) correspondence of a model, in HF's order. `model_type`: the HF architecture
    where its tensors are not named by the switches alone (phi3: fused projections of what is otherwise Llama)."""
    if cfg.family == "gpt2":
        top, layer_tensors, prefix = _gpt2(cfg)
    elif cfg.mla.kv_lora_rank:
        top, layer_tensors, prefix = _deepseek(cfg)
    elif hf_gpt_oss(cfg):
        top, layer_tensors, prefix = _gpt_oss(cfg)
    else:
        top, layer_tensors, prefix = _llama(cfg, model_type)
    out = [Pair(t.hf, t.ours, None, t) for t in top]
    for i in range(cfg.layers):
        for t in layer_tensors(i):
            path = ("blocks", *t.ours) if cfg.scan_layers else ("blocks", i, *t.ours)
            layer = i if cfg.scan_layers else None
            if t.per_expert:
                out += [Pair(prefix.format(i=i) + t.hf.format(j=j), path, layer, t, j) for j in range(cfg.moe.experts)]
            else:
                out.append(Pair(prefix.format(i=i) + t.hf, path, layer, t))
    return out


def to_ours(t: Tensor, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """An HF tensor -> our parameter (one layer's slice of it when stacked), float32."""
    index, parts = t.part
    if t.interleave:
        x = x[..., index::parts]  # (..., out / parts)
    elif parts > 1:  # a slice of the output axis: equal parts, or of `sizes`
        x = np.split(x, np.cumsum(t.sizes)[:-1] if t.sizes else parts, axis=t.out_axis)[index]
    x = x.T if t.transpose else x  # torch Linear (out, in) -> (in, out)
    x = np.asarray(x, np.float32).reshape(shape)
    return x + np.float32(t.offset) if t.offset else x


def to_hf(t: Tensor, x: np.ndarray) -> np.ndarray:
    """Our parameter (one layer of it) -> its part of the HF tensor."""
    if t.stacked:
        return x
    x = x.reshape(-1) if t.in_axes is None else x.reshape(math.prod(x.shape[: t.in_axes]), -1)  # (in, out)
    x = np.asarray(x, np.float32) - np.float32(t.offset) if t.offset else x
    return x.T if t.transpose else x  # (in, out) -> torch Linear's (out, in)


def join(t: Tensor, parts: list[np.ndarray]) -> np.ndarray:
    """The HF tensor made of `to_hf`'s parts (in `part` order): joined along its output axis, or interleaved
    column by column (`interleave`: GPT-OSS's gate_up_proj)."""
    if len(parts) == 1:
        return parts[0]
    if t.interleave:
        return np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)  # (..., out * parts)
    return np.concatenate(parts, axis=t.out_axis)


def hf_shape(group: list[Pair], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the HF tensor made of `group`'s parts, each of our (per-layer) `shape`; what `to_hf` and the
    concatenation of the parts give, without building it."""
    t = group[0].tensor
    if t.stacked:
        return (*shape[:-1], shape[-1] * len(group))
    if t.in_axes is None:
        return (math.prod(shape) * len(group),)
    rows, cols = math.prod(shape[: t.in_axes]), math.prod(shape[t.in_axes:])  # (in, out)
    cols = sum(t.sizes) if t.sizes else cols * len(group)  # the parts side by side on the output axis
    return (cols, rows) if t.transpose else (rows, cols)


def group_by(items: list[Pair], key: Callable[[Pair], Any]) -> dict[Any, list[Pair]]:
    """`items` grouped by `key`, groups and their members in first-seen order."""
    groups: dict[Any, list[Pair]] = {}
    for p in items:
        groups.setdefault(key(p), []).append(p)
    return groups


def part_shape(shape: tuple[int, ...], pair: Pair) -> tuple[int, ...]:
    """The shape of `pair`'s part of a parameter of `shape`: without the leading `layers` axis when stacked and the
    experts axis of a per-expert tensor."""
    return shape[len(pair.index):]
