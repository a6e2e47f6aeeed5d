"""What `systolic plan lm --serve` compiles: the inference engine's step (step.py `jit_step`, the program `systolic
serve` runs) lowered from abstract inputs, nothing allocated, on a tensor-parallel mesh of the target's devices
(sizing.py `tensor_layout`), for one format of the weights and of the KV cache. The step is continuous batching's:
one token for each of B decoding sequences and a chunk of a new prompt, in one ragged batch.

Weights, as the engine serves a float32 checkpoint (serve/weights.py `served_checkpoint`): "bf16" stores the
parameters in bfloat16 (the norms' scales and the few other float32 ones in float32); "int8" and "w8a8" store the
projections as Qwix int8 arrays quantized from float32 with a scale per output channel, the scales then stored in
bfloat16 (model/quant.py `quantize_params`; w8a8 quantizes the activations too). KV cache: the engine's pool
(kernels/paged_attention/pool.py), in the compute dtype ("bf16") or int8 with a float32 scale per token, layer, key or
value and head ("int8", `--kv-cache int8`), lowered as the engine allocates it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from systolic.data.tokenizer import make_tokenizer
from systolic.errors import UserError
from systolic.kernels.paged_attention import kernel as kernel_lib
from systolic.kernels.paged_attention.metadata import RaggedBatch
from systolic.kernels.paged_attention.pool import (default_page_size, heads_split, pool_shape, pool_shardings,
                                                   token_bytes)
from systolic.kernels.paged_attention.tuned_block_sizes import blocks_for
from systolic.plan.serving import ServeModel
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate, with_shardings
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model import quant
from systolic.workloads.lm.model.flops import matmul_params
from systolic.workloads.lm.model.lora import base_config
from systolic.workloads.lm.model.layers import resolve_dtype
from systolic.workloads.lm.serve.sizing import pool_layout, pool_row, tensor_layout
from systolic.workloads.lm.serve.scheduler import page_bucket
from systolic.workloads.lm.serve.step import MAX_BANNED, RowSampling, jit_step
from systolic.workloads.lm.serve.weights import served_checkpoint
from systolic.workloads.lm.model.build import init_params, model_graphdef, param_shardings

WEIGHTS = ("bf16", "int8", "w8a8")  # not fp8: no planned target has fp8 matmuls (quant.SCHEMES has it)
KV_TYPES = ("bf16", "int8")
_KV_CACHE = {"bf16": "auto", "int8": "int8"}  # --kv's names -> the engine's (kernels/paged_attention/pool.py)


def serve_model(cfg: LMConfig, devices: list, *, weights: str, kv: str, page_size: int | None = None) -> ServeModel:
    """The engine's step for `cfg`'s model with `weights` and a `kv` cache, split over `devices` (tensor parallel),
    in pages of `page_size` tokens (None: `systolic serve`'s default on the devices' platform)."""
    model = base_config(cfg.model)  # as the engine serves a LoRA run: merged
    model = dataclasses.replace(model, moe=dataclasses.replace(model.moe, capacity_factor=0.0))  # dropless, as served
    if weights not in WEIGHTS or kv not in KV_TYPES:
        raise UserError(f"--weights {weights} --kv {kv}: expected weights among bf16, int8, w8a8 and a KV cache of "
                        f"{' or '.join(KV_TYPES)} (fp8 needs a chip with fp8 matmuls, which no planned target has). "
                        "Fix: e.g. --weights bf16,int8 --kv bf16,int8.")
    vocab = model.padded_vocab(make_tokenizer(cfg.data.tokenizer).vocab_size)
    mesh, rules = tensor_layout(model, len(devices), devices)
    served = dataclasses.replace(model, quant=quant.SCHEMES[weights][1] if weights != "bf16" else "none")
    shardings = param_shardings(served, vocab, mesh, rules)
    with activate(mesh, rules):
        floats = jax.eval_shape(lambda: init_params(served, vocab, jax.random.key(0)))
    params = jax.eval_shape(lambda p: served_checkpoint(p, None if weights == "bf16" else weights, jnp.bfloat16,
                                                        stacked=model.scan_layers), floats)
    if weights != "bf16":
        shardings = quant.quantized_shardings(shardings, params)
    params = with_shardings(params, shardings)
    dtype = resolve_dtype(model.dtype)
    pool_sharding = pool_layout(params, mesh, rules)
    if page_size is None:
        page_size = default_page_size(_KV_CACHE[kv], devices[0].platform)
    row = pool_row(model)  # a token's row: kv_heads x [k | v], MLA's latent row
    split = heads_split(pool_sharding, row.width)  # devices the key/value heads split over
    kv_cache = _KV_CACHE[kv]
    step = jit_step(model_graphdef(served, vocab), mesh=mesh, param_shardings=shardings,
                    pool_sharding=pool_shardings(pool_shape(row, 1, page_size, kv_cache, split), pool_sharding))
    table = -(-model.max_seq_len // page_size)  # page-table entries per row, as the engine lays them out
    replicated = NamedSharding(mesh, P())

    def lower(tokens: int, rows: int, reading: int, pages: int):
        """The step of `tokens` token slots and `rows` rows, `reading` of the tokens reading pages."""
        shape = pool_shape(row, pages, page_size, kv_cache, split)
        pool = jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), shape,
                            pool_shardings(shape, pool_sharding))
        ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)  # noqa: E731
        reals = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=replicated)  # noqa: E731
        batch = RaggedBatch(ints(tokens), ints(tokens), ints(tokens), ints(), ints(rows, table), ints(rows),
                            ints(rows + 1), ints(1), ints(rows), ints(rows))
        sampling = RowSampling(reals(rows), ints(rows), reals(rows),
                               jax.ShapeDtypeStruct((rows, 2), jnp.uint32, sharding=replicated), ints(rows), reals(rows),
                               ints(rows, MAX_BANNED))
        with activate(mesh, rules):
            # previous: the last step's sampled tokens, (2, max_seqs); here rows is max_seqs.
            return step.lower(params, pool, ints(tokens), ints(2, rows), batch, sampling, ints(), reading)

    def lower_step(sequences: int, prefill: int, pages: int):
        # The engine's step with max_seqs = sequences + 1 and max_tokens_per_step = sequences + prefill: a token for
        # each decoding sequence, laid out first (they read pages), then a fresh prompt's chunk (it reads none).
        tokens = sequences + prefill
        return lower(tokens, sequences + (prefill > 0), page_bucket(tokens, sequences), pages)

    matmul = matmul_params(model, vocab) - model.d_model * vocab  # the layers' (the LM head's counted per row)
    kv_bytes = token_bytes(row, kv_cache)  # the lowered pool's, scales included
    mla = model.mla
    latent = f"({mla.kv_lora_rank} latent + {mla.qk_rope_head_dim} RoPE key)"
    if mla.kv_lora_rank and kv == "int8":  # MLA's cache: the compressed latent and the RoPE key (lm/model/mla.py)
        formula = f"{model.layers} layers x ({latent} x 1 byte + a 4-byte scale)"
    elif mla.kv_lora_rank:
        formula = f"{model.layers} layers x {latent} x {jnp.dtype(dtype).itemsize} bytes"
    elif kv == "int8":
        formula = f"2 x {model.layers} layers x {model.n_kv_heads} KV heads x ({model.d_head} x 1 byte + a 4-byte scale)"
    else:
        formula = (f"2 x {model.layers} layers x {model.n_kv_heads} KV heads x {model.d_head} x "
                   f"{jnp.dtype(dtype).itemsize} bytes")
    embed = params["embed"]
    return ServeModel(
        weights=weights, kv=kv if kv == "int8" else _name(dtype),
        params=sum(math.prod(x.shape) for x in jax.tree.leaves(floats)),
        weight_bytes=quant.param_bytes(params), weight_bytes_per_chip=mesh_lib.bytes_per_device(params),
        weight_read_bytes_per_chip=mesh_lib.bytes_per_device(params) - (
            0 if model.tie_embeddings else mesh_lib.bytes_per_device(embed)),
        kv_bytes_per_token=kv_bytes, kv_formula=formula, kv_split=split,
        page_size=page_size, matmul_flops_per_token=2.0 * matmul, head_flops_per_row=2.0 * model.d_model * vocab,
        attention_flops_per_key=attention_flops_per_key(model),
        window=model.sliding_window if any(model.local_layers) else 0,
        window_share=sum(model.local_layers) / model.layers,
        layers=model.layers, head_dim=model.d_head,
        kernel_block_keys=page_size * kernel_lib.pages_per_block(
            page_size, table, blocks_for(model.d_head, devices[0].device_kind).block_keys),
        int8_matmuls=weights == "w8a8",
        lower_step=lower_step)


def attention_flops_per_key(model) -> float:
    """Multiply-adds x 2 of one query token against one cached key, all layers: scores and value mix per head;
    MLA's absorbed decode reads a latent row of kv_lora_rank + qk_rope_head_dim and mixes kv_lora_rank values."""
    if model.mla.kv_lora_rank:
        return 2.0 * model.layers * model.heads * (model.mla.cache_width + model.mla.kv_lora_rank)
    return 4.0 * model.layers * model.heads * model.d_head


def _name(dtype: jnp.dtype) -> str:
    return "bf16" if dtype == jnp.bfloat16 else jnp.dtype(dtype).name
