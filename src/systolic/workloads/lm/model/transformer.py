"""Decoder-only transformer (Llama or GPT-2 block) in Flax NNX, with a KV cache for decoding.

Parameters are float32 and carry logical axis names (see `systolic.runtime.sharding`); the math runs in the
compute dtype (`ModelConfig.dtype`). Parameter names map to Hugging Face tensors (Llama, Qwen2, Qwen3, Mistral |
GPT-2) up to transposes and reshapes: `embed` is model.embed_tokens | wte, `blocks.attn.wq` self_attn.q_proj, and so
on; lm/hf/tensors.py converts, and the whole table is in docs/design-notes.md, this module's section.

With `scan_layers` the block parameters are stacked on a leading `layers` axis; otherwise `blocks` is a list.
Gemma's RMSNorm multiplies by (1 + w): its w is our scale - 1 (lm/hf/tensors.py converts), so the norm here is one.
Layers differ only in their kind (lm/model/layer_kind.py: sliding or full attention by `model.layer_types`, with
`model.rope_local_theta` their RoPE base, and rotated or not by `model.no_rope_layers`): Python bools per layer when
the blocks are a list, traced ones (scanned beside the stacked weights) where stacked layers of a scan differ.
With `model.lora` a targeted projection `w*` has a low-rank adapter `w*_lora` (a, b) beside it (lm/model/lora.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.errors import UserError
from systolic.runtime.sharding import constrain
from systolic.workloads.lm.model.config import PipelineConfig
from systolic.workloads.lm.model import moe as moe_lib
from systolic.workloads.lm.model import quant as quant_lib
from systolic.workloads.lm.model import remat as remat_lib
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.cpu import cpu_tweak, gradient_barrier
from systolic.workloads.lm.model.layer_kind import LayerKind, layer_kinds, stacked_kinds, with_traced
from systolic.workloads.lm.model.layers import Norm, param, resolve_dtype
from systolic.workloads.lm.model.mla import MultiHeadLatentAttention
from systolic.workloads.lm.model.parametrization import output_multiplier
from systolic.workloads.lm.model.sublayers import ACT, MLP, Attention, MoE, Ropes, make_ropes
from systolic.workloads.lm.model.kv_cache import KVCache
from systolic.workloads.lm.parallel import context
from systolic.workloads.lm.parallel import pipeline as pipeline_lib
from systolic.kernels.paged_attention.paged_kv import PagedKV

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
