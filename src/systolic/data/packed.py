"""Whole examples packed into rows, for supervised fine-tuning: the rows, the Grain iterator over them, eval batches.

A row is `seq_len + 1` tokens, as a text window is (data/text.py): inputs are its first `seq_len` tokens and targets
its last `seq_len`. Examples are placed whole (one longer than a row was cut to a row's length before, data/sft.py)
by best-fit decreasing: longest first (ties in file order), each into the row whose free space fits it most
tightly, a new row when none has room. That is deterministic and leaves little padding; the order of the rows
does not matter, Grain shuffles them. The rest of a row is padding.

Every token carries flags: whether it starts an example (or the padding after the last one) and whether it is a
target to learn (an assistant token). A batch holds `inputs`, `targets`, `segment_ids` and `positions` (what
data.packing=documents gives: the model attends within each example and positions restart at 0 in each) and
`loss_mask`, 1 where the target is a token to learn. An example's first token never is: nothing of its example
precedes it, and its target slot belongs to the previous example's last input, which must not learn across
examples. The padding is a segment of its own, never in the loss.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

import grain
import numpy as np

from systolic.data import text
from systolic.errors import UserError

START, LEARN = 1, 2  # bits of a token's flags: it opens an example (or the padding); it is a target to learn
BATCH_KEYS = (*text.batch_keys(packed=True), "loss_mask")  # each an int32 (B, seq_len) array

Example = tuple[np.ndarray, np.ndarray]  # token ids (N,) and a bool mask (N,) of the tokens to learn


class PackedRows:
    """Rows of whole examples: `tokens` (R, row_len) of the tokenizer's dtype, padded with `pad_id`, and `flags`
    (R, row_len) uint8 (START, LEARN)."""

    def __init__(self, tokens: np.ndarray, flags: np.ndarray, pad_id: int):
        self.tokens, self.flags, self.pad_id = tokens, flags, pad_id
        # The repr names the content, as TokenWindows' does, so a resumed run can check it reads the same rows.
        digest = hashlib.blake2b(np.ascontiguousarray(tokens), digest_size=8)
        digest.update(np.ascontiguousarray(flags))
        self._digest = digest.hexdigest()

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def row_len(self) -> int:
        return self.tokens.shape[1]

    def batch(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The rows `index` (n,) as a batch (module docstring); index -1 is an empty row (padding only)."""
        index = np.asarray(index)
        tokens, flags = self.tokens[index], self.flags[index]  # (n, row_len) each
        empty = index < 0
        tokens[empty], flags[empty] = self.pad_id, 0
        flags[empty, 0] = START
        return as_batch(tokens, flags)

    def __repr__(self) -> str:
        return f"PackedRows(rows={len(self)}, row_len={self.row_len}, blake2b={self._digest})"


def pack(examples: Sequence[Example], row_len: int, *, pad_id: int, dtype: type) -> PackedRows:
    """`examples` (each at most `row_len` tokens) placed whole into rows of `row_len` tokens by best-fit decreasing."""
    rows = best_fit([len(ids) for ids, _ in examples], row_len)
    return fill([[examples[i] for i in members] for members in rows], row_len, pad_id=pad_id, dtype=dtype)


def best_fit(sizes: Sequence[int], row_len: int) -> list[list[int]]:
    """Best-fit decreasing: the indices of the items of `sizes` (each at most `row_len`) that each row holds."""
    rows: list[list[int]] = []  # each row's items, by index
    free_sizes: list[int] = []  # sorted: the distinct amounts of free space that some row has
    rows_with: dict[int, list[int]] = {}  # free space -> the rows with exactly that much
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties keep file order
        size = sizes[i]
        assert 0 < size <= row_len, (size, row_len)
        k = bisect.bisect_left(free_sizes, size)  # the tightest fit: O(log row_len), whatever the number of rows
        if k == len(free_sizes):
            row, free = len(rows), row_len
            rows.append([])
        else:
            free = free_sizes[k]
            row = rows_with[free].pop()
            if not rows_with[free]:
                del rows_with[free], free_sizes[k]
        rows[row].append(i)
        left = free - size
        if left:
            if left not in rows_with:
                bisect.insort(free_sizes, left)
                rows_with[left] = []
            rows_with[left].append(row)
    return rows


def fill(rows: Sequence[Sequence[Example]], row_len: int, *, pad_id: int, dtype: type) -> PackedRows:
    """Rows of `row_len` tokens holding the given examples in order, each a segment of its own, then padding."""
    tokens = np.full((len(rows), row_len), pad_id, dtype)
    flags = np.zeros((len(rows), row_len), np.uint8)
    for r, members in enumerate(rows):
        at = 0
        for ids, learn in members:
            tokens[r, at : at + len(ids)] = ids
            flags[r, at : at + len(ids)] = np.where(learn, LEARN, 0)
            flags[r, at] = START  # and not LEARN: the first token has nothing of its example before it
            at += len(ids)
        if at < row_len:
            flags[r, at] = START  # the padding
    return PackedRows(tokens, flags, pad_id)


def as_batch(tokens: np.ndarray, flags: np.ndarray) -> dict[str, np.ndarray]:
    """Rows (B, row_len) of tokens and flags -> the batch's int32 (B, row_len - 1) arrays (BATCH_KEYS)."""
    tokens = tokens.astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}  # (B, T) each
    # Segment ids number the examples of a row from 1 (the row's first token always starts one), the padding last.
    batch["segment_ids"], batch["positions"] = text.segments_from_starts((flags[:, :-1] & START) != 0)
    batch["loss_mask"] = ((flags[:, 1:] & LEARN) != 0).astype(np.int32)  # (B, T): of each input's target
    return batch


class _ReadLocalRows:
    """Keeps this process's rows of a global batch of row indices and reads only those rows."""

    def __init__(self, rows: PackedRows, start: int, stop: int):
        self.rows, self.start, self.stop = rows, start, stop

    def __call__(self, global_indices: np.ndarray) -> dict[str, np.ndarray]:
        return self.rows.batch(global_indices[self.start : self.stop])

    def __repr__(self) -> str:
        return f"_ReadLocalRows({self.rows!r}, rows=[{self.start}:{self.stop}])"


def make_train_iterator(rows: PackedRows, *, global_batch: int, seed: int, process_index: int = 0,
                        process_count: int = 1) -> grain.DatasetIterator:
    """An endless Grain iterator of this process's share of shuffled global batches of rows (BATCH_KEYS, each
    (global_batch // process_count, row_len - 1)); its state is the same small dict on any number of processes,
    as `text.make_train_iterator`'s."""
    local = text.local_share(global_batch, process_index, process_count)
    if len(rows) < global_batch:
        raise UserError(
            f"The training examples fill {len(rows)} rows of data.seq_len + 1 = {rows.row_len} tokens, fewer than one "
            f"batch of train.batch_size={global_batch}. Fix: add examples, or lower train.batch_size or data.seq_len."
        )
    read = _ReadLocalRows(rows, process_index * local, (process_index + 1) * local)
    return text.shuffled_batches(len(rows), read, global_batch=global_batch, seed=seed)


def make_eval_batches(rows: PackedRows, *, batch: int, num_batches: int) -> list[dict[str, np.ndarray]]:
    """Fixed eval batches of `batch` rows: every row when they fit in `num_batches` batches, else that many
    batches of rows spread evenly; the last batch is filled up with empty rows, which add nothing to the loss."""
    used = min(len(rows), batch * num_batches)
    assert used, "no held-out rows"  # data/sft.py holds out at least one example
    chosen = np.arange(used) * len(rows) // used  # distinct, evenly spaced, first row always included
    chosen = np.concatenate([chosen, np.full(-used % batch, -1)])  # -1: an empty row
    return [rows.batch(chosen[i : i + batch]) for i in range(0, len(chosen), batch)]
