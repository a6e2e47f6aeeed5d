"""Multi-head latent attention (DeepSeek-V2/V3, `model.mla`): the llama block's attention when
model.mla.kv_lora_rank > 0, as transformers' DeepseekV3Attention computes it.

Per token, x (D) becomes
    queries   q = x wq, or q_b(norm(x q_a)) with model.mla.q_lora_rank   (H, nope + rope) per head
    latent    c = norm(x wkv_a[:, :r])                                   (r,) = kv_lora_rank, shared by all heads
    RoPE key  k_rope = RoPE(x wkv_a[:, r:])                              (rope,), shared by all heads
    keys      k = [c wkv_b[:, h, :nope], k_rope]                         (H, nope + rope)
    values    v = c wkv_b[:, h, nope:]                                   (H, v_head_dim)
with RoPE on the query's and key's rope parts only, logits scaled by 1/sqrt(nope + rope) or model.attn_logit_scale.

Training (no cache) expands the latent into per-head keys and values and runs `model.attention`'s implementation,
padding v and q, k to one width so that every kernel, the context-parallel ring included, takes it. Decoding caches
only [c, k_rope] per token and layer and absorbs wkv_b into the query and the output (the standard MLA decode):
multi-query attention over the latent, r + rope reads per cached token instead of H x (nope + rope + v). The
padding and the absorption, derived: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.runtime.sharding import constrain
from systolic.workloads.lm.model import attention
from systolic.workloads.lm.model import quant as quant_lib
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.layers import Norm, param, resolve_dtype
from systolic.workloads.lm.model.rope import apply_rope
from systolic.workloads.lm.parallel import context
from systolic.kernels.paged_attention.paged_kv import PagedKV

# transformers' DeepseekV3RMSNorm of q_a and of the latent keeps its default eps whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nnx.Module):
    """The attention of one layer under model.mla (the module docstring). Parameters (HF DeepseekV3Attention's):
    wq (D, H, nope + rope) q_proj | wq_a (D, rq) q_a_proj, q_norm q_a_layernorm, wq_b (rq, H, nope + rope) q_b_proj;
    wkv_a (D, r + rope) kv_a_proj_with_mqa, kv_norm kv_a_layernorm, wkv_b (r, H, nope + v) kv_b_proj, wo (H, v, D)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        mla, d, h, std = cfg.mla, cfg.d_model, cfg.heads, cfg.init_std
        self.dtype = resolve_dtype(cfg.dtype)
        self.quant = cfg.quant
        self.attention_setting = cfg.attention
        self.context_attention = cfg.context_attention
        self.nope, self.rope_dim, self.v_dim, self.rank = (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
                                                       mla.kv_lora_rank)
        self.interleave = mla.rope_interleave
        self.scale = cfg.attn_logit_scale or 1 / math.sqrt(mla.qk_head_dim)  # on q . k
        latent_cfg = dataclasses.replace(cfg, norm_eps=LATENT_NORM_EPS)
        if mla.q_lora_rank:
            self.wq = None
            self.wq_a = param(rngs.params(), (d, mla.q_lora_rank), ("embed", None), std)
            self.q_norm = Norm(latent_cfg, rngs=rngs, size=mla.q_lora_rank)
            self.wq_b = param(rngs.params(), (mla.q_lora_rank, h, mla.qk_head_dim), (None, "heads", "head_dim"), std)
        else:
            self.wq = param(rngs.params(), (d, h, mla.qk_head_dim), ("embed", "heads", "head_dim"), std)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = param(rngs.params(), (d, mla.cache_width), ("embed", None), std)
        self.kv_norm = Norm(latent_cfg, rngs=rngs, size=mla.kv_lora_rank)
        self.wkv_b = param(rngs.params(), (mla.kv_lora_rank, h, self.nope + self.v_dim), (None, "heads", "head_dim"),
                            std)
        # GPT-2's residual-projection init, as the grouped-query attention's.
        self.wo = param(rngs.params(), (h, self.v_dim, d), ("heads", "head_dim", "embed"),
                         std / math.sqrt(2 * cfg.layers))

    def _project(self, x: jax.Array, w: nnx.Param, contract: int = 1) -> jax.Array:
        return quant_lib.project(x, w[...].astype(self.dtype), contract, self.quant)

    def __call__(self, x, ropes, kind, start, kv, segment_ids=None):
        """As sublayers.Attention: x (B, T, D), kv None (training), this layer's cache (rows (B, S, r + rope),
        None) with x's rows written at `start`, or the engine's PagedKV. Every MLA layer is full and rotates (the
        config refuses windows and NoPE layers with MLA), so `kind` says nothing here. Returns (y (B, T, D),
        updated kv or None)."""
        del kind
        rope = ropes.full
        q = self._queries(x)  # (B, T, H, nope + rope)
        q_nope, q_rope = q[..., :self.nope], self._rotate(q[..., self.nope:], rope)
        kv_a = self._project(x, self.wkv_a)  # (B, T, r + rope)
        latent = self.kv_norm(kv_a[..., :self.rank])  # (B, T, r)
        k_rope = self._rotate(kv_a[..., None, self.rank:], rope)  # (B, T, 1, rope): one key head for all
        if kv is None:
            out = self._expanded(q_nope, q_rope, latent, k_rope, segment_ids)  # (B, T, H, v)
        else:
            out, kv = self._absorbed(q_nope, q_rope, jnp.concatenate([latent, k_rope[:, :, 0]], -1), start, kv)
        return self._project(out, self.wo, contract=2), kv  # (B, T, D)

    def _queries(self, x: jax.Array) -> jax.Array:
        """x (B, T, D) -> q (B, T, H, nope + rope)."""
        if self.wq is not None:
            return self._project(x, self.wq)
        return self._project(self.q_norm(self._project(x, self.wq_a)), self.wq_b)  # (B, T, rq) -> (B, T, H, qk)

    def _rotate(self, x: jax.Array, rope) -> jax.Array:
        """RoPE of x (B, T, N, rope). DeepSeek's interleaved pairs are de-interleaved first, [x0, x2, ...,
        x1, x3, ...]: rotate-half of that is transformers' `apply_rotary_pos_emb_interleave`, output layout
        included, so the cached RoPE keys are transformers' too."""
        if self.interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rope(x, rope)

    def _expanded(self, q_nope, q_rope, latent, k_rope, segment_ids) -> jax.Array:
        """Training: the latent expanded into per-head keys and values, then causal attention by model.attention's
        implementation (or the context-parallel one). Returns (B, T, H, v)."""
        kv_b = self._project(latent, self.wkv_b)  # (B, T, H, nope + v)
        B, T, H, _ = kv_b.shape
        k_rope = jnp.broadcast_to(k_rope, (B, T, H, self.rope_dim))  # the one RoPE key, in every head
        k = jnp.concatenate([kv_b[..., :self.nope], k_rope], -1)  # (B, T, H, qk)
        q = jnp.concatenate([q_nope, q_rope], -1)  # (B, T, H, qk)
        v = kv_b[..., self.nope:]  # (B, T, H, v)
        width = max(q.shape[-1], self.v_dim)  # one head size for the kernels: zero columns added where short
        pad = lambda a: jnp.pad(a, ((0, 0),) * 3 + ((0, width - a.shape[-1]),))  # noqa: E731
        # Every implementation scales by 1/sqrt(width): scaling q reaches them all.
        q, k, v = pad(q) * (self.scale * math.sqrt(width)), pad(k), pad(v)
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        split = context.current_split()
        if split is not None:
            out = context.attention(q, k, v, segment_ids, split=split, variant=self.context_attention, window=0)
        else:
            impl = attention.choose(self.attention_setting, dtype=self.dtype, head_dim=width, seq_len=T,
                                    segments=segment_ids is not None)
            out = attention.causal_attention(q, k, v, impl=impl, segment_ids=segment_ids)
        return out[..., :self.v_dim]  # (B, T, H, v)

    def _absorbed(self, q_nope, q_rope, rows, start, kv) -> tuple[jax.Array, tuple | PagedKV]:
        """Decoding: the queries absorb wkv_b's key half and attend over the cached rows [c, k_rope] (B, S, r +
        rope) as one key head whose values are the rows' c; the output c-mix goes through wkv_b's value half.
        rows (B, T, r + rope): this step's, written into the cache first. Returns ((B, T, H, v), the cache)."""
        w = self.wkv_b[...].astype(self.dtype)  # (r, H, nope + v)
        q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, w[..., :self.nope])  # (B, T, H, r)
        q = jnp.concatenate([q_latent, q_rope], -1)  # (B, T, H, r + rope)
        if isinstance(kv, PagedKV):  # B = 1 row of T tokens from many sequences
            mixed, kv = kv.attend_latent(q[0], rows[0], value_dim=self.rank, scale=self.scale)  # (T, H, r)
            mixed = mixed[None]  # (1, T, H, r)
        else:
            cache = jax.lax.dynamic_update_slice(kv[0], rows.astype(kv[0].dtype), (0, start, 0))  # (B, S, r + rope)
            mask = attention.decode_mask(start + jnp.arange(q.shape[1]), cache.shape[1], 0)  # (T, S)
            mixed = latent_attention(q, cache, mask, scale=self.scale, value_dim=self.rank)  # (B, T, H, r)
            kv = (cache, None)
        return jnp.einsum("bthr,rhv->bthv", mixed, w[..., self.nope:]), kv  # (B, T, H, v)


def latent_attention(q: jax.Array, rows: jax.Array, mask: jax.Array, *, scale: float, value_dim: int) -> jax.Array:
    """Multi-query attention over latent rows: q (B, T, H, C), rows (B, S, C) the one key head, their first
    value_dim entries its values, mask (T, S) bool -> (B, T, H, value_dim). Scores and softmax in float32, as
    transformers' eager attention computes them."""
    s = jnp.einsum("bthc,bsc->bhts", q, rows, preferred_element_type=jnp.float32) * scale  # (B, H, T, S)
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(rows.dtype)  # every query sees at least itself
    out = jnp.einsum("bhts,bsc->bthc", p, rows[..., :value_dim], preferred_element_type=jnp.float32)
    return out.astype(q.dtype)  # (B, T, H, value_dim)
