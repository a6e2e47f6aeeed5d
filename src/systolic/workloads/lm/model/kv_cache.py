"""The model's own contiguous KV cache: every position decoded so far, one array a layer stack, what
`Transformer.decode` and the reference decoder (decode.py) carry. The serving engine's paged pool is another
layout of the same keys and values (kernels/paged_attention/), tested against this one."""

from __future__ import annotations

from typing import NamedTuple

import jax


class KVCache(NamedTuple):
    """Keys and values of every position decoded so far; all rows of the batch share `length`. With model.mla, `k`
    holds each position's latent and RoPE key (lm/model/mla.py) and `v` is None."""

    k: jax.Array  # (L, B, S, KV, hd) compute dtype; model.mla: (L, B, S, kv_lora_rank + qk_rope_head_dim)
    v: jax.Array | None  # (L, B, S, KV, hd); model.mla: None
    length: jax.Array  # () int32: positions [0, length) are filled
