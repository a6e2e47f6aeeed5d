"""`RaggedBatch`: where the tokens of one serving step come from and go to, what both the kernel and the plain
path read (the metadata ragged paged attention kernels take: kv_lens, page_indices, cu_q_lens, num_seqs)."""

from __future__ import annotations

from typing import NamedTuple

import jax


class RaggedBatch(NamedTuple):
    """Where the T token slots of one step (a bucket; the first `num_tokens` are real) come from and go to; S rows
    (a bucket; the first `num_seqs` are real) are the sequences with a chunk in this step, in token order."""

    positions: jax.Array  # (T,) int32: each token's position in its sequence (padding: 0)
    rows: jax.Array  # (T,) int32: each token's row in [0, S) (padding: 0)
    slots: jax.Array  # (T,) int32: page * page_size + offset where its key and value go (padding: the null page)
    num_tokens: jax.Array  # () int32
    page_table: jax.Array  # (S, pages_per_seq) int32: each row's pages in order (unused entries: the null page)
    kv_lens: jax.Array  # (S,) int32: each row's positions in the cache after this step (padding rows: 0)
    cu_q_lens: jax.Array  # (S + 1,) int32: row r's tokens are [cu_q_lens[r], cu_q_lens[r + 1])
    num_seqs: jax.Array  # (1,) int32
    last: jax.Array  # (S,) int32: the index of each row's last token, whose logits the step samples from
    # (S,) int32: each row's known tokens, prompt and sampled (padding rows: 0): the length LongRoPE picks its factors
    # by (lm/model/rope.py), so every chunk of a prompt rotates as the whole prompt does in one pass
    seq_lens: jax.Array
