"""Token windows for language modelling: the Grain training iterator, fixed eval batches, a unigram baseline.

A window is `seq_len + 1` tokens starting at a multiple of `seq_len`; inputs are its first `seq_len` tokens
and targets its last `seq_len`, so consecutive windows share one token and every token is a target once.

Documents are packed end to end, each followed by the end-of-document id. Given that id (`eot_id`, lm's
`data.packing=documents`), a batch also carries each input's document (`segment_ids`) and its position in that
document (`positions`), so the model can attend within documents only (`document_segments`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import grain
import numpy as np

from systolic.data.corpus import Document
from systolic.data.prepared import ConcatTokens, ShardedTokens
from systolic.data.tokenizer import Tokenizer
from systolic.errors import UserError

Tokens = np.ndarray | ShardedTokens | ConcatTokens  # in memory, or read from a prepared dataset's shards


def encode_documents(docs: Sequence[Document], tokenizer: Tokenizer) -> np.ndarray:
    """All documents as one token array of `tokenizer.dtype` (uint16, or uint32 past 65,536 ids), each
    followed by `tokenizer.eot_id`."""
    return encode_with_lengths(docs, tokenizer)[0]


def encode_with_lengths(docs: Sequence[Document], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """`encode_documents`, and each document's token count including its end-of-document id: (documents,) int64."""
    eot = np.array([tokenizer.eot_id], tokenizer.dtype)
    ids = tokenizer.encode_batch([doc.text for doc in docs])
    parts = [part for doc_ids in ids for part in (doc_ids, eot)]
    tokens = np.concatenate(parts) if parts else np.zeros(0, tokenizer.dtype)
    return tokens, np.array([len(doc_ids) + 1 for doc_ids in ids], np.int64)


class TokenWindows:
    """Random access to the non-overlapping `seq_len + 1` token windows of `tokens` (a trailing partial one is dropped).

    `tokens` is an array in memory or a prepared dataset's tokens (read from its shards)."""

    def __init__(self, tokens: Tokens, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self._offsets = np.arange(seq_len + 1)
        # The repr names the content, so a resumed run can check it reads the same tokens.
        if isinstance(tokens, ShardedTokens | ConcatTokens):  # named by shard checksums: hashing reads every token
            self._digest = tokens.content_digest
        else:
            self._digest = hashlib.blake2b(np.ascontiguousarray(tokens), digest_size=8).hexdigest()

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, index) -> np.ndarray:
        """Window `index` as (seq_len + 1,), or windows `index[:]` as (n, seq_len + 1) for an integer array."""
        index = np.asarray(index)
        if np.any((index < 0) | (index >= len(self))):
            raise IndexError(f"window index out of range [0, {len(self)}): {index}")
        return self.tokens[index[..., None] * self.seq_len + self._offsets]  # (..., seq_len + 1)

    def __repr__(self) -> str:
        return f"TokenWindows(tokens={len(self.tokens)}, seq_len={self.seq_len}, blake2b={self._digest})"


def batch_keys(packed: bool) -> tuple[str, ...]:
    """The keys of a batch, each an int32 (B, seq_len) array: with `eot_id` given (`packed`), four, else two."""
    return ("inputs", "targets", "segment_ids", "positions") if packed else ("inputs", "targets")


def document_segments(inputs: np.ndarray, eot_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Each input token's document in its window, and its position in that document: (segment_ids, positions),
    int32 arrays shaped like `inputs` (B, T).

    The end-of-document token opens the next document, as a beginning-of-sequence token would (and as `generate`
    starts a fresh document from it), so no target crosses a boundary that the model cannot see across: a
    document's last token predicts the end-of-document id, which predicts the next document's first token.
    Segment ids count the end-of-document tokens at or before each input; a document cut by the window's start is
    segment 0 and starts at position 0."""
    return segments_from_starts(inputs == eot_id)


def segments_from_starts(starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions) int32 (B, T) of inputs where `starts` (B, T) bool marks each segment's first
    input: segment ids count the starts at or before each input, positions count from the segment's start (a
    segment cut by the row's start begins at position 0)."""
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)  # (B, T)
    index = np.arange(starts.shape[1], dtype=np.int32)  # (T,)
    start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)  # (B, T): where each input's segment starts
    return segment_ids, index - start


def _as_batch(windows: np.ndarray, eot_id: int | None) -> dict[str, np.ndarray]:
    windows = windows.astype(np.int32)  # (B, seq_len + 1)
    batch = {"inputs": windows[:, :-1], "targets": windows[:, 1:]}  # (B, seq_len) each
    if eot_id is not None:
        batch["segment_ids"], batch["positions"] = document_segments(batch["inputs"], eot_id)  # (B, seq_len) each
    return batch


class _ReadLocalRows:
    """Keeps this process's rows of a global batch of window indices and reads only those windows."""

    def __init__(self, windows: TokenWindows, start: int, stop: int, eot_id: int | None):
        self.windows, self.start, self.stop, self.eot_id = windows, start, stop, eot_id

    def __call__(self, global_indices: np.ndarray) -> dict[str, np.ndarray]:
        return _as_batch(self.windows[global_indices[self.start : self.stop]], self.eot_id)

    def __repr__(self) -> str:
        return f"_ReadLocalRows({self.windows!r}, rows=[{self.start}:{self.stop}]{_segments_repr(self.eot_id)})"


def _segments_repr(eot_id: int | None) -> str:
    return "" if eot_id is None else f", segments at eot={eot_id}"


def make_train_iterator(
    tokens: Tokens, *, seq_len: int, global_batch: int, seed: int, process_index: int = 0, process_count: int = 1,
    eot_id: int | None = None,
) -> grain.DatasetIterator:
    """An endless Grain iterator of this process's share of shuffled global batches.

    Yields `{'inputs', 'targets'}` int32 arrays of shape (global_batch // process_count, seq_len), and with
    `eot_id` also `segment_ids` and `positions` (`document_segments`). Every process
    walks the same global batches of window indices, so `get_state()` (a small JSON-able dict) does not depend
    on the process count and a checkpoint resumes on any number of hosts.
    """
    local = local_share(global_batch, process_index, process_count)
    windows = TokenWindows(tokens, seq_len)
    if len(windows) < global_batch:
        raise UserError(
            f"The training corpus is too small: {len(tokens)} tokens give {len(windows)} windows of data.seq_len="
            f"{seq_len}, fewer than one batch of train.batch_size={global_batch}. Fix: use a larger corpus (raise "
            "data.max_bytes or point data.path at more text), or lower data.seq_len or train.batch_size."
        )
    read = _ReadLocalRows(windows, process_index * local, (process_index + 1) * local, eot_id)
    return shuffled_batches(len(windows), read, global_batch=global_batch, seed=seed)


def shuffled_batches(num_rows: int, read: Callable[[np.ndarray], dict[str, np.ndarray]], *, global_batch: int,
                     seed: int) -> grain.DatasetIterator:
    """An endless Grain iterator of `read(indices)` for global batches of row indices in [0, num_rows), shuffled
    anew each epoch; `read` keeps this process's rows. Its state is one position, the same on every process."""
    dataset = (
        # Grain reshuffles each epoch with seed + epoch, so seeds s and s + 1 would replay each other's orders one
        # epoch apart; hashing the seed puts different seeds' epoch orders ~2**31 epochs apart.
        grain.MapDataset.range(num_rows)
        .shuffle(seed=_mix_seed(seed))
        .repeat(None)
        .batch(global_batch, drop_remainder=True)  # (global_batch,) row indices; may straddle two epochs
        .map(read)
    )
    # Grain's defaults (16 threads, 500 batches ahead) would hold gigabytes of large batches; reading a batch
    # is one numpy gather, so a couple of batches ahead hides it behind the device step.
    return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)))


def make_mixture_iterator(
    sources: Sequence[Tokens], weights: Sequence[float], *, seq_len: int, global_batch: int,
    seed: int, process_index: int = 0, process_count: int = 1, eot_id: int | None = None,
) -> grain.DatasetIterator:
    """`make_train_iterator` over several token sources: each source's windows are shuffled and repeated on their
    own, then interleaved by `weights` (Grain's `MapDataset.mix`, deterministic), so a batch holds about
    `weights[i] / sum(weights)` of its rows from source i, and the iterator's state is one index as before."""
    local = local_share(global_batch, process_index, process_count)
    windows = [TokenWindows(tokens, seq_len) for tokens in sources]
    for i, w in enumerate(windows):
        if not len(w):
            raise UserError(
                f"Mixture source {i + 1} has {len(sources[i])} training tokens: not one window of data.seq_len={seq_len}. "
                "Fix: drop it from data.mixture or lower data.seq_len."
            )
    tagged = [
        grain.MapDataset.range(len(w)).shuffle(seed=(_mix_seed(seed) + i) % 2**32).repeat(None).map(_Tag(i))
        for i, w in enumerate(windows)
    ]
    dataset = (
        grain.MapDataset.mix(tagged, list(weights))
        .batch(global_batch, drop_remainder=True)  # (global_batch, 2): (source, window) pairs
        .map(_ReadLocalMixedRows(windows, process_index * local, (process_index + 1) * local, eot_id))
    )
    return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)))


def mixture_counts(rows: int, weights: Sequence[float]) -> list[int]:
    """How many of the first `rows` rows of `make_mixture_iterator` come from each source: exact, in O(sources).

    Grain's `MapDataset.mix` scales the weights to integers (the smallest to 100) and deals element k to the first
    source at which a nested floor division of k and k + 1 differs (`mix._dataset_and_key_of_next_element`); the
    same divisions applied to `rows` count each source's share of the prefix. A test checks this against Grain."""
    scale = 100 / min(weights)
    proportions = [int(w * scale) for w in weights]
    remaining, left, counts = sum(proportions), rows, []
    for p in proportions:
        rest = left * (remaining - p) // remaining  # of the prefix, the elements dealt to later sources
        counts.append(left - rest)
        left, remaining = rest, remaining - p
    return counts


class _Tag:
    def __init__(self, source: int):
        self.source = source

    def __call__(self, window: int) -> np.ndarray:
        return np.array([self.source, window], np.int64)

    def __repr__(self) -> str:
        return f"_Tag({self.source})"


class _ReadLocalMixedRows:
    """`_ReadLocalRows` for (source, window) pairs."""

    def __init__(self, windows: list[TokenWindows], start: int, stop: int, eot_id: int | None):
        self.windows, self.start, self.stop, self.eot_id = windows, start, stop, eot_id

    def __call__(self, pairs: np.ndarray) -> dict[str, np.ndarray]:
        pairs = pairs[self.start : self.stop]  # (local, 2)
        out = np.empty((len(pairs), self.windows[0].seq_len + 1), np.int64)
        for source, windows in enumerate(self.windows):
            rows = pairs[:, 0] == source
            if rows.any():
                out[rows] = windows[pairs[rows, 1]]
        return _as_batch(out, self.eot_id)

    def __repr__(self) -> str:
        return f"_ReadLocalMixedRows({self.windows!r}, rows=[{self.start}:{self.stop}]{_segments_repr(self.eot_id)})"


def local_share(global_batch: int, process_index: int, process_count: int) -> int:
    """Rows of each global batch that one process reads; a UserError when the processes cannot share it equally."""
    if global_batch % process_count:
        raise UserError(
            f"The global batch size ({global_batch}) is not divisible by the number of processes ({process_count}), "
            "so the processes cannot take equal shares of each batch. Fix: set train.batch_size to a multiple of "
            f"{process_count}."
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is outside [0, {process_count})")
    return global_batch // process_count


def _mix_seed(seed: int) -> int:
    digest = hashlib.blake2b(f"systolic-train-order-{seed}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")  # in [0, 2**32), the range Grain accepts


def make_eval_batches(tokens: Tokens, *, seq_len: int, batch: int, num_batches: int,
                      eot_id: int | None = None) -> list[dict[str, np.ndarray]]:
    """Fixed eval batches: whole batches of windows spread evenly over `tokens`, at most `batch * num_batches`,
    with the keys that `make_train_iterator` gives for the same `eot_id`. Validation text shorter than one batch of
    windows but longer than one window (a small corpus's held-out part) gives one batch of overlapping windows."""
    windows = TokenWindows(tokens, seq_len)
    if len(windows) < batch:
        if len(windows) == 0:
            raise UserError(
                f"The validation split is too small: {len(tokens)} tokens, fewer than one window of data.seq_len + 1 = "
                f"{seq_len + 1}, so nothing can be evaluated. Fix: lower data.seq_len, or raise data.val_percent (or "
                "data.max_bytes), or add text."
            )
        # Evaluating every held-out token, some in two windows, beats refusing a small corpus: the windows' starts
        # are spread evenly from the first token to the last full window's.
        starts = np.arange(batch) * (len(tokens) - seq_len - 1) // (batch - 1) if batch > 1 else np.zeros(1, int)
        return [_as_batch(np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)]), eot_id)]  # (batch, T + 1)
    used = min(len(windows), batch * num_batches) // batch * batch
    chosen = np.arange(used) * len(windows) // used  # distinct, evenly spaced, first window always included
    return [_as_batch(windows[chosen[i : i + batch]], eot_id) for i in range(0, used, batch)]


def unigram_cross_entropy(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Nats per validation token under the training tokens' unigram distribution with add-one smoothing.

    A model that has learnt anything beats this; one that has not sits at or above it.
    """
    return unigram_cross_entropy_from_counts(np.bincount(train_tokens, minlength=vocab_size),
                                             np.bincount(val_tokens, minlength=vocab_size))


def unigram_cross_entropy_from_counts(train_counts: np.ndarray, val_counts: np.ndarray) -> float:
    """`unigram_cross_entropy` from the (vocab_size,) counts of each id in the two splits."""
    counts = train_counts.astype(np.float64) + 1.0
    log_prob = np.log(counts) - np.log(counts.sum())  # (vocab_size,)
    return float(-(val_counts * log_prob).sum() / val_counts.sum())
