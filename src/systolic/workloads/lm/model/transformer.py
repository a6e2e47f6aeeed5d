"""Decoder-only transformer (Llama or GPT-2 block) in Flax NNX, with a KV cache for decoding.

Parameters are float32 and carry logical axis names (see `systolic.runtime.sharding`); the math runs in the
compute dtype (`ModelConfig.dtype`). Names map to Hugging Face tensors (Llama, Qwen2, Qwen3, Mistral | GPT-2), up
to transposes and reshapes (HF Linear stores (out, in), GPT-2's Conv1D (in, out)); Norm.scale/bias are HF's
weight/bias:

    embed                   model.embed_tokens                  | wte
    pos_embed               -                                   | wpe
    blocks.attn_norm        input_layernorm                     | ln_1
    blocks.attn.wq, wk, wv  self_attn.{q,k,v}_proj (rotate-half) | attn.c_attn split in three (+ bq, bk, bv)
    blocks.attn.bq, bk, bv  self_attn.{q,k,v}_proj.bias (qkv_bias) | (above)
    blocks.attn.q_norm, k_norm  self_attn.{q,k}_norm (qk_norm)  | -
    blocks.attn.wo          self_attn.o_proj (+ bo: attn_out_bias) | attn.c_proj (+ bo)
    blocks.attn.sinks       self_attn.sinks (GPT-OSS, attn_sinks) | -
    blocks.attn (model.mla) DeepSeek-V3's self_attn: lm/model/mla.py
    (Phi-3 fuses wq, wk, wv into self_attn.qkv_proj and w_gate, w_up into mlp.gate_up_proj: lm/hf/tensors.py)
    blocks.attn_post_norm   post_attention_layernorm (Gemma 2/3, OLMo 2: norm_placement=sandwich, post) | -
    blocks.mlp_norm         post_attention_layernorm (pre_feedforward_layernorm in Gemma 2/3) | ln_2
    blocks.mlp_post_norm    post_feedforward_layernorm (Gemma 2/3)  | -
    blocks.mlp              {gate,up,down}_proj: w_gate, w_up, w_down | c_fc: w_fc, b_fc; c_proj: w_proj, b_proj
    blocks.mlp (model.moe)  router, experts stacked (E, ...) w_gate, w_up, w_down, shared, shared_gate (hf_tensors.py)
                            (+ router_bias, b_gate, b_up, b_down: GPT-OSS's router.bias and experts' biases)
    final_norm              model.norm                          | ln_f
    lm_head                 lm_head (absent when tie_embeddings)

With `scan_layers` the block parameters are stacked on a leading `layers` axis; otherwise `blocks` is a list.
Gemma's RMSNorm multiplies by (1 + w): its w is our scale - 1 (lm/hf/tensors.py converts), so the norm here is one.
Layers differ only in their kind (lm/model/layer_kind.py: sliding or full attention by `model.layer_types`, with
`model.rope_local_theta` their RoPE base, and rotated or not by `model.no_rope_layers`): Python bools per layer when
the blocks are a list, traced ones (scanned beside the stacked weights) where stacked layers of a scan differ.
With `model.lora` a targeted projection `w*` has a low-rank adapter `w*_lora` (a, b) beside it (lm/model/lora.py).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.errors import UserError
from systolic.runtime.sharding import constrain
from systolic.workloads.lm.model import attention
from systolic.workloads.lm.parallel import context
from systolic.workloads.lm.model import moe as moe_lib
from systolic.workloads.lm.parallel import pipeline as pipeline_lib
from systolic.workloads.lm.config import PipelineConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model import quant as quant_lib
from systolic.workloads.lm.model import remat as remat_lib
from systolic.workloads.lm.model.cpu import cpu_tweak, gradient_barrier, project
from systolic.workloads.lm.model.layers import Norm, param, param_from, resolve_dtype
from systolic.workloads.lm.model.layer_kind import LayerKind, layer_kinds, stacked_kinds, with_traced
from systolic.workloads.lm.model.lora import targeted_weights
from systolic.workloads.lm.model.mla import MultiHeadLatentAttention
from systolic.workloads.lm.model.parametrization import attention_correction, hidden_init_scale, output_multiplier
from systolic.workloads.lm.model.rope import rope_tables, rotate
from systolic.workloads.lm.serve.paged_attention import PagedKV

ACT = ("batch", "seq", "act_embed")


class Adapter(nnx.Module):
    """LoRA's low-rank update of one projection (in_shape) -> (out_shape), per layer: scale * (x A) B with
    A (*in, r) drawn as PEFT draws it and B (r, *out) zero, so a fresh adapter changes nothing (lm/model/lora.py)."""

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], in_names: tuple[str | None, ...],
                 out_names: tuple[str | None, ...], *, rank: int, scale: float, rngs: nnx.Rngs):
        bound = 1 / math.sqrt(math.prod(in_shape))  # PEFT's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), ...)
        uniform = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)  # noqa: E731
        # `lora_rank` is replicated (runtime/sharding.py); the other axes shard as the adapted weight's do.
        self.a = param_from(uniform, rngs.params(), (*in_shape, rank), (*in_names, "lora_rank"))
        self.b = param_from(nnx.initializers.zeros, rngs.params(), (rank, *out_shape), ("lora_rank", *out_names))
        self.contract = len(in_shape)
        self.scale = scale

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., *in) in the compute dtype -> (..., *out) in that dtype."""
        h = project(x, self.a[...].astype(x.dtype), contract=self.contract)  # (..., r)
        # Scaled after B, as PEFT does; a Python float is weakly typed, so the product keeps x's dtype.
        return project(h, self.b[...].astype(x.dtype)) * self.scale  # (..., *out)


def _adapter(cfg: ModelConfig, weight: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
             in_names: tuple[str | None, ...], out_names: tuple[str | None, ...], rngs: nnx.Rngs) -> Adapter | None:
    """The adapter of our weight `weight` (e.g. "wq") when model.lora targets it, else None."""
    if weight not in targeted_weights(cfg):
        return None
    return Adapter(in_shape, out_shape, in_names, out_names, rank=cfg.lora.rank, scale=cfg.lora.scale, rngs=rngs)


def _adapted(x: jax.Array, y: jax.Array, adapter: Adapter | None) -> jax.Array:
    """y = x W plus the adapter's update of it, if W has one. With B = 0 this adds exact zeros: y is unchanged."""
    return y if adapter is None else y + adapter(x)


class KVCache(NamedTuple):
    """Keys and values of every position decoded so far; all rows of the batch share `length`. With model.mla, `k`
    holds each position's latent and RoPE key (lm/model/mla.py) and `v` is None."""

    k: jax.Array  # (L, B, S, KV, hd) compute dtype; model.mla: (L, B, S, kv_lora_rank + qk_rope_head_dim)
    v: jax.Array | None  # (L, B, S, KV, hd); model.mla: None
    length: jax.Array  # () int32: positions [0, length) are filled


class Ropes(NamedTuple):
    """cos and sin tables (each (B or 1, T, hd)) of the full layers and of the sliding ones (the same tables unless
    model.rope_local_theta gives the sliding layers their own base)."""

    full: tuple[jax.Array, jax.Array]
    sliding: tuple[jax.Array, jax.Array]

    def of(self, local: bool | jax.Array) -> tuple[jax.Array, jax.Array]:
        """The tables of a layer that is sliding (`local`, a Python bool or a traced one) or full."""
        if self.sliding is self.full:
            return self.full
        if isinstance(local, bool):
            return self.sliding if local else self.full
        return jax.tree.map(lambda s, f: jnp.where(local, s, f), self.sliding, self.full)


def make_ropes(positions: jax.Array, cfg: ModelConfig, extent: jax.Array | None = None) -> Ropes | None:
    """The RoPE tables of positions (B or 1, T) for each kind of layer; None for GPT-2's learned positions (and
    when no layer rotates). `extent`: the sequence lengths LongRoPE decides by (rope.rope_tables)."""
    if cfg.family != "llama" or not any(cfg.rope_layers):
        return None
    full = rope_tables(positions, cfg, extent=extent)
    return Ropes(full, rope_tables(positions, cfg, local=True, extent=extent) if cfg.rope_local_theta else full)


class _Projecting(nnx.Module):
    """What Attention and MLP share: x times one of their weights in the compute dtype, with model.quant's operands
    (a weight may be stored quantized for serving: lm/model/quant.py)."""

    dtype: jnp.dtype
    quant: str

    def _project(self, x: jax.Array, w: nnx.Param, contract: int = 1) -> jax.Array:
        weight = w[...]
        if weight.dtype != self.dtype:
            # The float32 weight as stored, then its cast: without the barrier the TPU compiler rewrote the cast
            # of each scanned layer's weights so that, under model.remat=context, it ran two of the MLP's matmuls a
            # second time in the backward pass (llama-1b-v5e: 26 matmuls a layer instead of 24, 14% more of XLA's
            # FLOPs); with it, 24 (docs/performance.md, "The whole llama-1b on one v5e").
            weight = jax.lax.optimization_barrier(weight)
        return quant_lib.project(x, weight.astype(self.dtype), contract, self.quant)


class Attention(_Projecting):
    """Causal grouped-query attention, within `model.sliding_window` positions when set: in training by
    `model.attention`'s implementation (`lm/model/attention.py`), against a KV cache through
    `jax.nn.dot_product_attention` with an explicit mask. Qwen2's q/k/v biases (`qkv_bias`) and Qwen3's per-head
    RMSNorm of q and k before RoPE (`qk_norm`) are switches of the llama block."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.d_model, cfg.heads, cfg.n_kv_heads, cfg.d_head
        std = cfg.init_std * hidden_init_scale(cfg)  # muP: variance 1/fan_in (1 under the standard parametrization)
        self.dtype = resolve_dtype(cfg.dtype)
        self.quant = cfg.quant
        self.attention_setting = cfg.attention
        self.context_attention = cfg.context_attention
        self.window = cfg.sliding_window  # on the sliding layers
        self.softcap = cfg.attn_logit_softcap
        # muP's 1/d_head attention (1 under the standard parametrization), or model.attn_logit_scale instead of
        # every implementation's 1/sqrt(hd).
        self.q_scale = cfg.attn_logit_scale * math.sqrt(hd) if cfg.attn_logit_scale else attention_correction(cfg)
        self.wq = param(rngs.params(), (d, h, hd), ("embed", "heads", "head_dim"), std)
        self.wk = param(rngs.params(), (d, kv, hd), ("embed", "kv_heads", "head_dim"), std)
        self.wv = param(rngs.params(), (d, kv, hd), ("embed", "kv_heads", "head_dim"), std)
        # GPT-2's residual-projection init: keeps the residual stream's variance independent of depth.
        self.wo = param(rngs.params(), (h, hd, d), ("heads", "head_dim", "embed"), std / math.sqrt(2 * cfg.layers))
        if cfg.family == "gpt2" or cfg.qkv_bias:
            self.bq = param(rngs.params(), (h, hd), ("heads", "head_dim"), 0)
            self.bk = param(rngs.params(), (kv, hd), ("kv_heads", "head_dim"), 0)
            self.bv = param(rngs.params(), (kv, hd), ("kv_heads", "head_dim"), 0)
        else:
            self.bq = self.bk = self.bv = None
        self.bo = param(rngs.params(), (d,), (None,), 0) if cfg.family == "gpt2" or cfg.attn_out_bias else None
        # GPT-OSS's sinks: one logit per query head in the softmax's denominator (attention.masked_attention).
        self.sinks = param(rngs.params(), (h,), ("heads",), cfg.init_std) if cfg.attn_sinks else None
        if cfg.qk_norm and cfg.qk_norm_scope == "all":  # one scale per (head, head_dim) entry
            self.q_norm = Norm(cfg, rngs=rngs, size=hd, names=("heads", "head_dim"), heads=h)
            self.k_norm = Norm(cfg, rngs=rngs, size=hd, names=("kv_heads", "head_dim"), heads=kv)
        elif cfg.qk_norm:
            self.q_norm = Norm(cfg, rngs=rngs, size=hd, names=("head_dim",))
            self.k_norm = Norm(cfg, rngs=rngs, size=hd, names=("head_dim",))
        else:
            self.q_norm = self.k_norm = None
        self.wq_lora = _adapter(cfg, "wq", (d,), (h, hd), ("embed",), ("heads", "head_dim"), rngs)
        self.wk_lora = _adapter(cfg, "wk", (d,), (kv, hd), ("embed",), ("kv_heads", "head_dim"), rngs)
        self.wv_lora = _adapter(cfg, "wv", (d,), (kv, hd), ("embed",), ("kv_heads", "head_dim"), rngs)
        self.wo_lora = _adapter(cfg, "wo", (h, hd), (d,), ("heads", "head_dim"), ("embed",), rngs)

    def __call__(self, x, ropes: Ropes | None, kind: LayerKind, start, kv, segment_ids=None):
        """x (B, T, D); `kind`: whether this is a sliding layer and whether it rotates q and k (traced bools in a scan
        over layers that differ);
        kv None (training: causal over x, within segments when `segment_ids` (B, T) is given),
        this layer's cache (k, v), each (B, S, KV, hd), into which x's keys/values are written at `start`, or an
        inference engine step's paged cache (lm/serve/paged_attention.py; B = 1 row of T tokens from many
        sequences). Returns (y (B, T, D), updated kv or None)."""
        dt = self.dtype
        local = kind.sliding
        q = _adapted(x, self._project(x, self.wq), self.wq_lora)  # (B, T, H, hd)
        k = _adapted(x, self._project(x, self.wk), self.wk_lora)  # (B, T, KV, hd)
        v = _adapted(x, self._project(x, self.wv), self.wv_lora)  # (B, T, KV, hd)
        if self.bq is not None:
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over hd per head, or over (heads, hd) (qk_norm_scope=all)
        if ropes is not None:
            rope = ropes.of(local)
            q, k = rotate(q, rope, kind.rope), rotate(k, rope, kind.rope)
        if self.q_scale != 1:
            # Every implementation scales the logits by 1/sqrt(hd); scaling q instead of the logits reaches all.
            q = q * self.q_scale
        q = remat_lib.tag(constrain(q, ("batch", "seq", "heads", "head_dim")), remat_lib.QKV)
        k, v = remat_lib.tag(k, remat_lib.QKV), remat_lib.tag(v, remat_lib.QKV)
        split = context.current_split() if kv is None else None
        kernel_named = False  # whether the attention's output already carries remat.ATTN_STATS
        sinks = None if self.sinks is None else self.sinks[...]  # (H,) float32, added to float32 scores
        if split is not None and sinks is not None:
            raise UserError(
                "model.attn_sinks=true with the sequence split over the mesh's context axis: the ring and all-gather "
                "attentions of context parallelism have no sink logits. Fix: mesh.context=1 for this model."
            )
        if split is not None:  # the sequence split over the context axis (lm/parallel/context.py), in its balanced order
            out = self._by_window(local, lambda window: context.attention(
                q, k, v, segment_ids, split=split, variant=self.context_attention, window=window))  # (B, T, H, hd)
        elif kv is None:
            impl = attention.choose(self.attention_setting, dtype=dt, head_dim=q.shape[-1], seq_len=q.shape[1],
                                    segments=segment_ids is not None, softcap=bool(self.softcap), sinks=sinks is not None)
            out = self._by_window(local, lambda window: attention.causal_attention(
                q, k, v, impl=impl, segment_ids=segment_ids, window=window, softcap=self.softcap,
                sinks=sinks))  # (B, T, H, hd)
            kernel_named = impl == "splash"
        elif isinstance(kv, PagedKV):  # the pages say which sequence each token belongs to and where it sits
            out, kv = kv.attend(q[0], k[0], v[0], window=self._window(local), softcap=self.softcap,
                                sinks=sinks)  # (T, H, hd)
            out = out[None]  # (1, T, H, hd)
        else:
            assert segment_ids is None, "decoding attends over one document per row"
            # is_causal aligns the diagonal at key 0, which is wrong once the cache holds earlier positions:
            # use the explicit mask (key position <= query position, within the window) instead.
            ck = jax.lax.dynamic_update_slice(kv[0], k, (0, start, 0, 0))  # (B, S, KV, hd)
            cv = jax.lax.dynamic_update_slice(kv[1], v, (0, start, 0, 0))  # (B, S, KV, hd)
            mask = attention.decode_mask(start + jnp.arange(q.shape[1]), ck.shape[1], self._window(local))  # (T, S)
            if self.softcap or sinks is not None:  # jax.nn.dot_product_attention has neither
                out = attention.masked_attention(q, ck, cv, mask[None], softcap=self.softcap,
                                                 sinks=sinks)  # (B, T, H, hd)
            else:
                out = jax.nn.dot_product_attention(q, ck, cv, mask=mask[None, None])  # (B, T, H, hd)
            kv = (ck, cv)
        if not kernel_named:
            # The splash kernel names its output (remat.ATTN_STATS) itself: tagging it again would have a policy
            # that keeps both names keep it twice (B, H, T, hd and B, T, H, hd): 1.2 GiB more temporaries on llama-1b-v5e.
            out = remat_lib.tag(out, remat_lib.CONTEXT)
        y = _adapted(out, self._project(out, self.wo, contract=2), self.wo_lora)  # (B, T, D)
        if self.bo is not None:
            y = y + self.bo[...].astype(dt)
        return remat_lib.tag(y, remat_lib.ATTN_OUT), kv

    def _window(self, local: bool | jax.Array) -> int | jax.Array:
        """This layer's window: model.sliding_window on a sliding layer, 0 (none) on a full one."""
        if isinstance(local, bool):
            return self.window if local else 0
        return jnp.where(local, self.window, 0)

    def _by_window(self, local: bool | jax.Array, attend):
        """attend(window) with this layer's window as a Python int, which the kernels need (splash's mask, cuDNN's
        window): a cond over the two kinds when `local` is traced (only the taken branch runs)."""
        if isinstance(local, bool):
            return attend(self._window(local))
        return jax.lax.cond(local, lambda: attend(self.window), lambda: attend(0))


class MLP(_Projecting):
    """SwiGLU (llama) or GELU-tanh with biases (gpt2); `width` overrides model.mlp_dim (MoE's shared experts)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, width: int = 0):
        d, m, std = cfg.d_model, width or cfg.d_mlp, cfg.init_std * hidden_init_scale(cfg)  # muP: variance 1/fan_in
        self.dtype = resolve_dtype(cfg.dtype)
        self.quant = cfg.quant
        self.llama = cfg.family == "llama"
        # The gate's activation: silu (SwiGLU) or GELU's tanh approximation (GeGLU, Gemma's gelu_pytorch_tanh).
        self.gelu_gate = cfg.mlp_activation == "gelu_tanh"
        out_std = std / math.sqrt(2 * cfg.layers)
        if self.llama:
            self.w_gate = param(rngs.params(), (d, m), ("embed", "mlp"), std)
            self.w_up = param(rngs.params(), (d, m), ("embed", "mlp"), std)
            self.w_down = param(rngs.params(), (m, d), ("mlp", "embed"), out_std)
        else:
            self.w_fc = param(rngs.params(), (d, m), ("embed", "mlp"), std)
            self.b_fc = param(rngs.params(), (m,), ("mlp",), 0)
            self.w_proj = param(rngs.params(), (m, d), ("mlp", "embed"), out_std)
            self.b_proj = param(rngs.params(), (d,), (None,), 0)
        # The up/gate projections (D -> M) and the down projection (M -> D) of either family, adapted or None.
        up, down = ((d,), (m,), ("embed",), ("mlp",)), ((m,), (d,), ("mlp",), ("embed",))
        self.w_gate_lora = _adapter(cfg, "w_gate", *up, rngs) if self.llama else None
        self.w_up_lora = _adapter(cfg, "w_up", *up, rngs) if self.llama else None
        self.w_down_lora = _adapter(cfg, "w_down", *down, rngs) if self.llama else None
        self.w_fc_lora = None if self.llama else _adapter(cfg, "w_fc", *up, rngs)
        self.w_proj_lora = None if self.llama else _adapter(cfg, "w_proj", *down, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        if self.llama:
            gate = _adapted(x, self._project(x, self.w_gate), self.w_gate_lora)  # (B, T, M)
            up = _adapted(x, self._project(x, self.w_up), self.w_up_lora)  # (B, T, M)
            act = jax.nn.gelu(gate, approximate=True) if self.gelu_gate else jax.nn.silu(gate)
            h = constrain(act * up, ("batch", "seq", "mlp"))
            return _adapted(h, self._project(h, self.w_down), self.w_down_lora)  # (B, T, D)
        h = _adapted(x, self._project(x, self.w_fc), self.w_fc_lora) + self.b_fc[...].astype(dt)  # (B, T, M)
        h = constrain(jax.nn.gelu(h, approximate=True), ("batch", "seq", "mlp"))
        y = _adapted(h, self._project(h, self.w_proj), self.w_proj_lora)  # (B, T, D)
        return y + self.b_proj[...].astype(dt)


class MoE(nnx.Module):
    """A mixture of SwiGLU experts (model.moe, lm/model/moe.py): a float32 router picks top_k of `experts` per token;
    optional shared experts (one MLP of shared_experts * the expert width) see every token, scaled by a sigmoid
    gate with `shared_gate` (Qwen2-MoE). GPT-OSS adds a router bias, expert biases and a clamped SwiGLU (model.moe's
    router_bias, expert_bias, swiglu_limit). Expert weights carry the logical `experts` axis (split over the `expert`
    mesh axis) and `expert_mlp` (their hidden axis)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe, d, e, m, std = cfg.moe, cfg.d_model, cfg.moe.experts, cfg.d_expert, cfg.init_std
        self.dtype = resolve_dtype(cfg.dtype)
        self.top_k, self.norm_topk_prob, self.capacity_factor = moe.top_k, moe.norm_topk_prob, moe.capacity_factor
        self.router = param(rngs.params(), (d, e), ("embed", None), std)
        # DeepSeek-V3's correction bias on the sigmoid scores: it steers the choice only, so it gets no gradient.
        self.score_correction = param(rngs.params(), (e,), (None,), 0) if moe.scoring == "sigmoid" else None
        self.moe = moe
        self.w_gate = param(rngs.params(), (e, d, m), ("experts", "embed", "expert_mlp"), std)
        self.w_up = param(rngs.params(), (e, d, m), ("experts", "embed", "expert_mlp"), std)
        self.w_down = param(rngs.params(), (e, m, d), ("experts", "expert_mlp", "embed"), std / math.sqrt(2 * cfg.layers))
        self.shared = MLP(cfg, rngs=rngs, width=moe.shared_experts * m) if moe.shared_experts else None
        self.shared_gate = param(rngs.params(), (d, 1), ("embed", None), std) if moe.shared_gate else None
        self.router_bias = param(rngs.params(), (e,), (None,), 0) if moe.router_bias else None
        if moe.expert_bias:
            self.b_gate = param(rngs.params(), (e, m), ("experts", "expert_mlp"), 0)
            self.b_up = param(rngs.params(), (e, m), ("experts", "expert_mlp"), 0)
            self.b_down = param(rngs.params(), (e, d), ("experts", None), 0)
        else:
            self.b_gate = self.b_up = self.b_down = None
        self.clamp = moe_lib.SwigluClamp(moe.swiglu_alpha, moe.swiglu_limit) if moe.swiglu_limit else None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, moe_lib.MoeStats]:
        """x (B, T, D) -> (y (B, T, D), this layer's stats)."""
        b, t, d = x.shape
        dt = self.dtype
        # Rows of B*T tokens (XLA partitions top_k over one split axis), but (B, T) when the sequence is split over
        # the context axis: flattening rows split over two mesh axes would gather the sequence (x).
        tokens = x if context.current_split() else x.reshape(b * t, d)
        if self.score_correction is None:
            routing = moe_lib.route(tokens, self.router[...], self.top_k, self.norm_topk_prob,
                                    bias=None if self.router_bias is None else self.router_bias[...])
        else:
            routing = moe_lib.route_grouped(tokens, self.router[...], self.score_correction[...], self.moe)
        biases = () if self.b_gate is None else (self.b_gate[...].astype(dt), self.b_up[...].astype(dt))
        w = moe_lib.Experts(self.w_gate[...].astype(dt), self.w_up[...].astype(dt), self.w_down[...].astype(dt),
                            *biases, clamp=self.clamp)
        y, dropped = moe_lib.experts_forward(x, routing, w, self.capacity_factor)  # (B, T, D)
        if self.b_down is not None:  # GPT-OSS: each chosen expert's bias, by its routing weight
            y = y + moe_lib.down_bias(self.b_down[...], routing.experts, routing.weights).reshape(b, t, d).astype(dt)
        if self.shared is not None:
            shared = self.shared(x)  # (B, T, D)
            if self.shared_gate is not None:
                gate = jax.nn.sigmoid(project(x, self.shared_gate[...].astype(dt)))  # (B, T, 1)
                shared = shared * gate
            y = y + shared
        return y, moe_lib.router_stats(routing, dropped)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP a mixture of experts with `moe`.
    With model.norm_placement=sandwich each sublayer's output is normed too: x + norm(attn(norm(x))) (Gemma 2/3);
    with post only the output is: x + norm(attn(x)) (OLMo 2). model.residual_multiplier scales each sublayer's
    output before the sum (Granite)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        pre, post = cfg.norm_placement != "post", cfg.norm_placement != "pre"
        self.attn_norm = Norm(cfg, rngs=rngs) if pre else None
        self.attn = MultiHeadLatentAttention(cfg, rngs=rngs) if cfg.mla.kv_lora_rank else Attention(cfg, rngs=rngs)
        self.attn_post_norm = Norm(cfg, rngs=rngs) if post else None
        self.mlp_norm = Norm(cfg, rngs=rngs) if pre else None
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)
        self.mlp_post_norm = Norm(cfg, rngs=rngs) if post else None
        self.residual_multiplier = cfg.residual_multiplier

    def __call__(self, x, ropes, kind: LayerKind, start, kv, segment_ids=None):
        """Returns (x, kv, the MoE layer's stats or None); `kind`: the layer's kind (lm/model/layer_kind.py)."""
        # Not with the sequence split: the barrier's backward reads the gradient's first element, for which XLA
        # would gather the whole sequence onto every device.
        if kv is None and cpu_tweak("barrier") and context.current_split() is None:
            x = gradient_barrier(x)
        y, kv = self.attn(x if self.attn_norm is None else self.attn_norm(x), ropes, kind, start, kv, segment_ids)
        x = constrain(x + self._residual(y, self.attn_post_norm), ACT)
        y = self.mlp(x if self.mlp_norm is None else self.mlp_norm(x))
        y, stats = y if isinstance(self.mlp, MoE) else (y, None)
        x = constrain(x + self._residual(y, self.mlp_post_norm), ACT)
        return x, kv, stats

    def _residual(self, y: jax.Array, post_norm: Norm | None) -> jax.Array:
        """A sublayer's output y (B, T, D) as it joins the residual stream: normed (sandwich, post), scaled."""
        y = y if post_norm is None else post_norm(y)
        # A Python float is weakly typed: the product keeps y's dtype, as Granite multiplies in the model's.
        return y if self.residual_multiplier == 1 else y * self.residual_multiplier


class Transformer(nnx.Module):
    """`model(tokens)` -> logits for training; `model.decode(tokens, cache)` -> (logits, cache) for sampling."""

    def __init__(self, cfg: ModelConfig, vocab: int, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.vocab = vocab
        self.dtype = resolve_dtype(cfg.dtype)
        self.logit_scale = output_multiplier(cfg)
        self.embed_multiplier = cfg.embed_multiplier
        self.final_softcap = cfg.final_logit_softcap
        self.logit_divisor = cfg.logit_divisor
        self.embed = param(rngs.params(), (vocab, cfg.d_model), ("vocab", "embed"), cfg.init_std)
        if cfg.family == "gpt2":
            self.pos_embed = param(rngs.params(), (cfg.max_seq_len, cfg.d_model), (None, "embed"), cfg.init_std)
        else:
            self.pos_embed = None
        if cfg.scan_layers:
            # One Block whose parameters gain a leading `layers` axis, each layer with its own init key.
            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs=rngs, moe=bool(cfg.moe_layers))  # all MoE or none (ModelConfig checks)

            self.blocks = make_blocks(rngs)
        else:
            new_block = lambda rngs, moe: Block(cfg, rngs=rngs, moe=moe)  # noqa: E731
            if isinstance(rngs.params.key[...], jax.core.Tracer):
                # Under a trace (jit, eval_shape), each layer in its own small one: a nested jit, inlined where the
                # model's program compiles (the same values). In one trace, every key drawn from `rngs` costs time
                # in proportion to the trace's length (flax reads the traced count's `sharding`, and jax's error
                # for it walks the trace), so L layers cost O(L^2): 128 took 4 minutes to trace; 1,024 would take hours.
                new_block = nnx.jit(new_block, static_argnums=1)
            self.blocks = nnx.List([new_block(rngs, cfg.moe.is_moe_layer(i)) for i in range(cfg.layers)])
        self.final_norm = Norm(cfg, rngs=rngs)
        if cfg.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = param(rngs.params(), (cfg.d_model, vocab), ("embed", "vocab"), cfg.init_std)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, pipeline: PipelineConfig | None = None) -> jax.Array:
        """tokens int32 (B, T) -> logits float32 (B, T, vocab), causal over T.

        Documents packed into a row (`data.packing=documents`) pass `segment_ids` (B, T), so a token attends only
        to earlier tokens of its own segment, and `positions` (B, T), each token's position in its document (for
        the rotary or learned position embedding); by default one document per row at positions 0..T-1. With
        `pipeline`, on a mesh with mesh.stage > 1 the layers run as a pipeline over the stages (lm/parallel/pipeline.py)."""
        logits, _, _ = self._forward(tokens, None, segment_ids, positions, pipeline)
        return logits

    def with_moe_stats(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                       positions: jax.Array | None = None, pipeline: PipelineConfig | None = None,
                       ) -> tuple[jax.Array, moe_lib.MoeStats | None]:
        """As `__call__`, plus the MoE layers' stats stacked on a leading axis (None for a dense model): what
        training adds to the loss and reports. With `pipeline`, on a mesh with mesh.stage > 1 the layers run as a
        pipeline over the stages (lm/parallel/pipeline.py; dense models only)."""
        logits, _, stats = self._forward(tokens, None, segment_ids, positions, pipeline)
        return logits, stats

    def decode(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Runs tokens (B, T) at positions cache.length + [0, T) against the cache (prefill: T = prompt length,
        a step: T = 1). Returns logits float32 (B, T, vocab) and the cache with their keys/values appended."""
        logits, cache, _ = self._forward(tokens, cache)
        return logits, cache

    def decode_paged(self, tokens: jax.Array, kv: PagedKV, *,
                     every_token: bool = False) -> tuple[jax.Array, jax.Array]:
        """One inference engine step (lm/serve): tokens (T,) of many sequences, at kv.batch.positions, against the
        paged pool kv.pool (L, pages, page_size, KV * 2 * hd). Returns the logits float32 (S, V) of each row's last
        token (kv.batch.last), or with `every_token` (T, V) of every token (prompt log-probabilities), and the pool
        with the tokens' keys and values written."""
        cfg = self.cfg
        positions = kv.batch.positions[None]  # (1, T)
        x = self.embed_tokens(tokens[None], positions)  # (1, T, D)
        # Each token's sequence length, all its known tokens (a prompt's every chunk as the whole prompt): what
        # LongRoPE decides by, as transformers' forward pass over the sequence does.
        ropes = make_ropes(positions, cfg, extent=kv.batch.seq_lens[kv.batch.rows][None])

        def apply(block: Block, carry, layer, kind):
            x, pool = carry
            x, paged, _ = block(x, ropes, kind, None, kv._replace(pool=pool, layer=layer))
            return x, paged.pool

        carry = (x, kv.pool)
        if cfg.scan_layers:  # the pool rides in the carry: each layer updates it in place
            scan = functools.partial(nnx.scan, out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
            shared, traced = stacked_kinds(cfg)  # what differs between layers scanned beside their weights

            def scanned(block, carry, layer, traced):
                return apply(block, carry, layer, with_traced(shared, traced))

            carry = scan(scanned, in_axes=(0, nnx.Carry, 0, 0))(self.blocks, carry, jnp.arange(cfg.layers), traced)
        else:
            for i, block in enumerate(self.blocks):
                carry = apply(block, carry, i, layer_kinds(cfg)[i])
        x, pool = carry
        logits = self.readout(x if every_token else x[:, kv.batch.last])  # (1, T or S, V)
        return logits[0], pool

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for `batch` rows of up to `max_len` positions."""
        cfg = self.cfg
        if cfg.mla.kv_lora_rank:  # the latent and the RoPE key of each position (lm/model/mla.py)
            rows = jnp.zeros((cfg.layers, batch, max_len, cfg.mla.cache_width), self.dtype)
            return KVCache(rows, None, jnp.zeros((), jnp.int32))
        shape = (cfg.layers, batch, max_len, cfg.n_kv_heads, cfg.d_head)
        return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype), jnp.zeros((), jnp.int32))

    def _forward(self, tokens, cache, segment_ids=None, positions=None, pipeline=None):
        cfg = self.cfg
        T = tokens.shape[1]
        if T > cfg.max_seq_len:
            raise UserError(
                f"Got {T} tokens per row, but the model attends over at most model.max_seq_len={cfg.max_seq_len} "
                f"positions. Fix: cut the input to {cfg.max_seq_len} tokens (data.seq_len) or raise model.max_seq_len."
            )
        start = jnp.zeros((), jnp.int32) if cache is None else cache.length
        if positions is None:
            positions = (start + jnp.arange(T, dtype=jnp.int32))[None]  # (1, T): every row alike
        split = context.current_split()
        if split is not None:
            tokens, segment_ids, positions = self._split_inputs(split, cache, tokens, segment_ids, positions)
        x = self.embed_tokens(tokens, positions)  # (B, T, D)
        ropes = make_ropes(positions, cfg)
        kv = None if cache is None else (cache.k, cache.v)

        def layer_fn(shared: LayerKind):
            """One layer of kind `shared`, but for the fields its 4th argument (a scan's per-layer kinds) sets."""
            def apply(block: Block, x, kv_layer, traced: LayerKind | None = None):
                return block(x, ropes, with_traced(shared, traced), start, kv_layer, segment_ids)

            if cfg.remat == "none":
                return apply
            # prevent_cse=False inside a scan (as MaxText): the scan already keeps XLA from merging the recomputed
            # forward into the original, and the barriers that prevent_cse adds cost fusions in every layer.
            return nnx.remat(apply, policy=remat_lib.policy(cfg.remat), prevent_cse=not cfg.scan_layers)

        mesh = jax.sharding.get_abstract_mesh()
        if pipeline is not None and cache is None and not mesh.empty and mesh.shape.get(pipeline_lib.AXIS, 1) > 1:
            x, stats = self._pipelined(x, ropes, segment_ids, pipeline, mesh), None  # (B, T, D)
        elif cfg.scan_layers:
            scan = functools.partial(nnx.scan, out_axes=(nnx.Carry, 0, 0),
                                     transform_metadata={nnx.PARTITION_NAME: "layers"})
            # What the layers share stays Python (a window the kernels need as an int); what differs is scanned
            # beside the weights.
            shared, traced = stacked_kinds(cfg)
            apply = scan(layer_fn(shared), in_axes=(0, nnx.Carry, 0, 0))
            x, kv, stats = apply(self.blocks, x, kv, traced)  # stats stacked (L, ...) or None
        else:
            new_kv, layer_stats = [], []
            kinds = layer_kinds(cfg)
            for i, block in enumerate(self.blocks):
                kv_i = None if kv is None else jax.tree.map(lambda a: a[i], kv)  # this layer's (MLA: v None)
                x, kv_i, stats_i = layer_fn(kinds[i])(block, x, kv_i)
                new_kv.append(kv_i)
                layer_stats += [] if stats_i is None else [stats_i]
            if kv is not None:
                kv = jax.tree.map(lambda *layers: jnp.stack(layers), *new_kv)  # (L, B, S, KV, hd) each (MLA: v None)
            stats = jax.tree.map(lambda *s: jnp.stack(s), *layer_stats) if layer_stats else None  # (L_moe, ...)

        if split is not None:
            x = context.from_balanced(x, split)  # (B, T, D) back in natural order, like the caller's targets
        logits = self.readout(x)  # (B, T, V)
        if cache is not None:
            cache = KVCache(kv[0], kv[1], cache.length + T)
        return logits, cache, stats

    def _split_inputs(self, split: context.Split, cache, tokens, segment_ids, positions):
        """The inputs of a forward pass whose sequence is split over the context axis, in the load-balanced order
        that lm/parallel/context.py's attention expects (RoPE and learned positions move with their tokens)."""
        if cache is not None:
            raise UserError(
                f"Decoding with a KV cache runs with the sequence whole, but the current sharding rules split it over "
                f"{split.n} devices of the mesh axis {' x '.join(split.axes)} (context parallelism is for training). "
                "Fix: decode on a mesh with mesh.context=1, or on one device as `systolic generate` does."
            )
        B, T = tokens.shape
        context.check_seq_len(T, split)
        tokens, positions = (context.to_balanced(a, split) for a in (tokens, jnp.broadcast_to(positions, (B, T))))
        segment_ids = None if segment_ids is None else context.to_balanced(segment_ids, split)
        return tokens, segment_ids, positions

    def _pipelined(self, x, ropes: Ropes | None, segment_ids, pipeline: PipelineConfig, mesh) -> jax.Array:
        """The stacked blocks over the stages (lm/parallel/pipeline.py): x (B, T, D) -> (B, T, D). Every layer is
        of one kind (pipeline.check refuses a mix)."""
        graphdef, weights = nnx.split(self.blocks)
        start = jnp.zeros((), jnp.int32)
        batch = x.shape[0]
        kind = layer_kinds(self.cfg)[0]
        # Per-example inputs of the blocks, cut into microbatches with the activations (rope may be shared: (1, T, hd)).
        rope = None if ropes is None else ropes.of(kind.sliding)
        rows = {"segment_ids": segment_ids,
                "rope": None if rope is None else tuple(jnp.broadcast_to(a, (batch, *a.shape[1:])) for a in rope)}

        def layer(layer_weights, h, row):
            block = nnx.merge(graphdef, layer_weights)
            layer_ropes = None if row["rope"] is None else Ropes(row["rope"], row["rope"])
            return block(h, layer_ropes, kind, start, None, row["segment_ids"])[0]

        if self.cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=remat_lib.policy(self.cfg.remat))
        return pipeline_lib.run(layer, weights, x, rows, microbatches=pipeline.microbatches,
                                repeats=pipeline.repeats, mesh=mesh)

    def embed_tokens(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """tokens (B, T) at positions (B or 1, T) -> the residual stream's input (B, T, D) in the compute dtype."""
        # Gather the fsdp-split columns first: a lookup into a table split on both axes makes the SPMD
        # partitioner fall back to replicating it ("involuntary full rematerialization").
        table = constrain(self.embed[...], ("vocab", None))  # (V, D)
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)  # (B, T, D)
        if self.embed_multiplier != 1:
            # A Python float is weakly typed: rounded to the compute dtype first, as Gemma rounds sqrt(d_model).
            x = x * self.embed_multiplier
        if self.pos_embed is not None:
            x = x + jnp.take(self.pos_embed[...], positions, axis=0).astype(self.dtype)  # (B or 1, T, D)
        return constrain(x, ACT)

    def readout(self, x: jax.Array) -> jax.Array:
        """The last block's output (B, T, D) -> logits float32 (B, T, V)."""
        x = self.final_norm(x)
        # float32 accumulation: logits feed a softmax over the whole vocabulary.
        if self.lm_head is None:
            logits = jnp.einsum("btd,vd->btv", x, self.embed[...].astype(self.dtype),
                                preferred_element_type=jnp.float32)
        else:
            logits = quant_lib.readout(x, self.lm_head[...].astype(self.dtype))
        if self.logit_scale != 1:
            logits = logits * self.logit_scale  # muP's readout multiplier 1/m
        if self.logit_divisor != 1:
            logits = logits / self.logit_divisor  # Granite's logits_scaling, before any cap
        if self.final_softcap:
            logits = self.final_softcap * jnp.tanh(logits / self.final_softcap)  # Gemma 2's cap, in float32
        return constrain(logits, ("batch", "seq", "vocab"))  # (B, T, V)


def make_model(cfg: ModelConfig, vocab: int, key_or_seed: jax.Array | int) -> Transformer:
    """A freshly initialised model. Call under `activate(mesh)` (ideally inside jit) to create it sharded."""
    return Transformer(cfg, vocab, rngs=nnx.Rngs(params=key_or_seed))
