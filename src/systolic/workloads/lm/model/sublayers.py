"""The sublayers of lm's decoder block (transformer.py): attention (grouped-query, with the KV cache, RoPE and the
kernels of attention.py), the dense MLP and the mixture-of-experts MLP, and the low-rank adapters their projections
take with `model.lora`. Parameter names and their Hugging Face counterparts: transformer.py's docstring."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.errors import UserError
from systolic.runtime.sharding import constrain
from systolic.workloads.lm.model import attention
from systolic.workloads.lm.model import moe as moe_lib
from systolic.workloads.lm.model import quant as quant_lib
from systolic.workloads.lm.model import remat as remat_lib
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.cpu import project
from systolic.workloads.lm.model.layer_kind import LayerKind
from systolic.workloads.lm.model.layers import Norm, param, param_from, resolve_dtype
from systolic.workloads.lm.model.lora import targeted_weights
from systolic.workloads.lm.model.parametrization import attention_correction, hidden_init_scale
from systolic.workloads.lm.model.rope import rope_tables, rotate
from systolic.workloads.lm.parallel import context
from systolic.kernels.paged_attention.paged_kv import PagedKV

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
        inference engine step's paged cache (kernels/paged_attention/paged_kv.py; B = 1 row of T tokens from many
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
