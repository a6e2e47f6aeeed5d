"""The serving engine's sizes and layout, settled before its weights are read or anything is compiled: the settings
checked against the model and the device's memory, the step size by default, the KV pool's pages and its layout,
and the tensor-parallel mesh."""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from systolic.config import MeshConfig
from systolic.errors import UserError
from systolic.kernels.paged_attention.pool import PoolRow, token_bytes
from systolic.runtime import memory
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.memory import gib, memory_stats
from systolic.runtime.sharding import RULE_SETS, Rules, logical_to_spec
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.layers import resolve_dtype

MAX_SEQS = 1 << 16  # requests one step may hold: far above what a device's memory serves (page tables, sampling)
MAX_TENSOR = 1 << 12  # devices one model may be split over: a pod's
KV_MEMORY_FRACTION = 0.8  # of a device's free memory (after the parameters) for the pool, when no budget is given


def check_sizes(kv_pages: int, page_size: int, max_seqs: int, max_tokens_per_step: int) -> None:
    if kv_pages < 2 or page_size < 1 or max_seqs < 1 or max_tokens_per_step < max_seqs:
        raise UserError(
            f"Engine sizes out of range: {kv_pages} KV pages of {page_size} tokens, max_seqs={max_seqs}, "
            f"max_tokens_per_step={max_tokens_per_step}. Expected at least 2 pages (one is reserved) of at least 1 "
            "token, max_seqs >= 1 and max_tokens_per_step >= max_seqs (every running request decodes one token a "
            "step). Fix: e.g. --page-size 16 --max-seqs 16 --max-tokens-per-step 256, and a larger --kv-memory-gib."
        )


def tokens_per_step(max_seqs: int) -> int:
    """The default step size: 256 tokens, or room for every sequence's next token and three times as many prompt
    tokens when that is more. With room for decodes alone, a wave of new prompts waits for steps of its own: llama-1b
    at 256 in flight on a v5e ran 12,896 output tok/s with 256 tokens a step and 18,333 with 1,024 (TTFT p50 1.2 s
    against 0.12 s; docs/benchmarks.md)."""
    return max(256, 4 * max_seqs)


def check_settings(model: ModelConfig, *, page_size: int, max_seqs: int, max_tokens_per_step: int,
                   mesh_tensor: int) -> None:
    """The engine's sizes against the model, before its weights are read or anything is compiled: a step never
    holds more than max_seqs whole contexts, so more tokens per step would only compile buckets (each a program
    over that many tokens) that no batch can fill."""
    context = model.max_seq_len
    if not 1 <= page_size <= context:
        raise UserError(f"--page-size {page_size}: a page holds 1 to {context} tokens (the model's context, "
                        "model.max_seq_len). Fix: e.g. --page-size 16.")
    if not 1 <= mesh_tensor <= MAX_TENSOR:
        raise UserError(f"--mesh-tensor {mesh_tensor}: the devices one model is split over, 1 (no split) to "
                        f"{MAX_TENSOR}. Fix: e.g. --mesh-tensor 1, or the number of devices that share the model.")
    if not 1 <= max_seqs <= MAX_SEQS:
        raise UserError(f"--max-seqs {max_seqs}: the requests that generate together, 1 to {MAX_SEQS:,}. Fix: e.g. "
                        "--max-seqs 16.")
    most = max_seqs * context
    if not max_seqs <= max_tokens_per_step <= most:
        raise UserError(f"--max-tokens-per-step {max_tokens_per_step}: a step holds at least one token of each of "
                        f"--max-seqs {max_seqs} requests and at most all of their contexts, {max_seqs} x {context} = "
                        f"{most:,} tokens. Fix: --max-tokens-per-step between {max_seqs} and {most:,}, e.g. 256.")
    # A lower bound of the largest step's activations, float32 per token: the residual, q, k, v and the MLP's two
    # hidden halves (a layer's; the step holds one layer's at a time).
    per_token = 4 * (4 * model.d_model + 2 * model.d_mlp)
    memory.check_fits(max_tokens_per_step * per_token, jax.devices()[:mesh_tensor],
                      what=f"A step of --max-tokens-per-step {max_tokens_per_step:,} tokens",
                      fix="a smaller --max-tokens-per-step (e.g. 256; prompts longer than a step are prefilled in "
                          "chunks).")


def tensor_layout(model: ModelConfig, tensor: int, devices: list[jax.Device] | None = None
                  ) -> tuple[jax.sharding.Mesh, Rules]:
    """A mesh of `tensor` of `devices` (default: this process's) on the tensor axis and the tp rules (Megatron:
    heads and MLP columns split). Key/value heads that do not split over `tensor` (fewer of them than devices) are
    replicated instead, as vLLM does."""
    devices = jax.devices() if devices is None else devices
    if not 1 <= tensor <= len(devices):
        raise UserError(f"Tensor parallelism over mesh.tensor={tensor} devices needs that many, but there are "
                        f"{len(devices)} here. Fix: mesh.tensor between 1 and {len(devices)}.")
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=tensor), devices[:tensor])
    split_kv = kv_splits(model, tensor)
    rules = tuple((name, None if name == "kv_heads" and not split_kv else axes) for name, axes in RULE_SETS["tp"])
    return mesh, rules


def kv_splits(model: ModelConfig, tensor: int) -> bool:
    """Whether the pool's key/value heads split over `tensor` devices: not MLA's one latent row, which every head
    reads (replicated, as vLLM does)."""
    return not model.mla.kv_lora_rank and model.n_kv_heads % tensor == 0


def pool_row(model: ModelConfig) -> PoolRow:
    """What the paged pool holds of `model` a token and layer: each key/value head's [k | v], or MLA's one row of
    latent and RoPE key (lm/model/mla.py)."""
    if model.mla.kv_lora_rank:
        return PoolRow(model.layers, model.mla.cache_width, 1, resolve_dtype(model.dtype))
    return PoolRow(model.layers, model.n_kv_heads * 2 * model.d_head, 2 * model.n_kv_heads, resolve_dtype(model.dtype))


def pool_layout(params: Any, mesh: jax.sharding.Mesh | None, rules: Rules | None) -> jax.sharding.Sharding:
    """The pool's layout: on a mesh, its key/value head axis split as the rules split kv_heads; otherwise on the
    parameters' devices (replicated when they are spread over several: the end-of-training sample)."""
    if mesh is not None:
        # A token's row is its heads' [k | v] one after another: split, each device holds whole heads.
        return NamedSharding(mesh, P(None, None, None, logical_to_spec(("kv_heads",), rules)[0]))
    home = jax.tree.leaves(params)[0].sharding
    return NamedSharding(home.mesh, P()) if isinstance(home, NamedSharding) else home


def pool_pages(model: ModelConfig, page_size: int, *, kv_memory_gib: float | None, max_seqs: int,
               device: jax.Device, split: int, kv_cache: str = "auto") -> tuple[int, str]:
    """(pages of the pool, a line that says its size and why). `split`: the devices the pool is split over."""
    page_bytes = page_size * token_bytes(pool_row(model), kv_cache)  # an int8 pool's values and scales
    full = -(-model.max_seq_len // page_size)  # pages of one full-length sequence
    if kv_memory_gib is not None:
        if not (math.isfinite(kv_memory_gib) and kv_memory_gib > 0):
            raise UserError(f"--kv-memory-gib {kv_memory_gib} must be a positive number of GiB. Fix: e.g. 1.")
        pages, why = int(kv_memory_gib * 2**30 // page_bytes), f"--kv-memory-gib {kv_memory_gib:g}"
    elif (free := _free_bytes(device)) is None:
        pages = max_seqs * full + 1
        why = (f"room for max_seqs={max_seqs} sequences of {model.max_seq_len} tokens ({device.platform} reports no "
               "free memory; --kv-memory-gib sets the size)")
    else:
        pages = int(KV_MEMORY_FRACTION * free * split // page_bytes)
        why = f"{KV_MEMORY_FRACTION:.0%} of the {gib(free)} free on each of {split} {device.platform} device(s)"
    if pages < 2:
        raise UserError(f"The KV cache would hold {pages} page(s) of {page_size} tokens ({why}); it needs at least 2 "
                        f"(one is reserved). Fix: a larger --kv-memory-gib (one page is {page_bytes:,} bytes).")
    # Per running sequence: its row of the page table (int32) and its hidden state (float32) in each decode step.
    per_seq = 4 * (full + model.d_model)
    memory.check_fits(pages * page_bytes + max_seqs * per_seq, [device] * split,
                      what=(f"The KV cache of {pages:,} pages of {page_size} tokens ({why}) and the batch of "
                            f"--max-seqs {max_seqs:,} sequences"),
                      fix="a smaller --kv-memory-gib or --max-seqs (or more devices).")
    return pages, (f"KV cache: {pages - 1:,} pages of {page_size} tokens = {(pages - 1) * page_size:,} tokens, "
                   f"{(pages - 1) / full:.1f} full-length sequences ({gib(pages * page_bytes)}"
                   f"{', int8 with float32 scales' if kv_cache == 'int8' else ''}), from {why}")


def _free_bytes(device: jax.Device) -> int | None:
    """A device's free memory, where its runtime says (GPU, TPU); None on CPU."""
    stats = memory_stats(device)
    return None if stats is None else int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
