"""Preference pairs for DPO (lm's objective=dpo): TRL's preference records -> token ids, packed into rows.

`data.path` is a .jsonl file (or .jsonl.gz), or a folder of them read in name order; each line is one pair in TRL's
preference format with an explicit prompt, standard (`{"prompt": "...", "chosen": "...", "rejected": "..."}`,
tokenized as TRL's `DPOTrainer` does) or conversational (lists of messages, rendered by the run's chat template as
data/sft.py renders `messages`). A pair is two sequences, prompt + chosen and prompt + rejected, and the
completion's tokens are the ones scored. Each sequence is cut to `max_len = (data.seq_len + 1) // 2` tokens, keeping
its start, and a pair whose prompt alone fills `max_len` is dropped, as TRL drops it; both are counted and reported.

Pairs are packed whole into rows of `data.seq_len + 1` tokens by best-fit decreasing (data/packed.py), both
sequences of a pair in the same row, each a segment of its own. A batch holds packed.py's keys, `sequence` (B, T)
(which of the row's sequences a completion target scores, -1 elsewhere) and `pair_ids` (B, T) (column k: the id of
the row's k-th pair, -1 past the row's pairs). Each pair is named `file:line` and held out for validation by the
stable hash of its name (`corpus.held_out`). How each format is tokenized and split, and the batch keys' exact
layout: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from systolic.data import corpus, packed, sft
from systolic.data.tokenizer import Tokenizer
from systolic.data.chat import LazyTemplate
from systolic.errors import UserError
from systolic.safe_json import json_kind

FIELDS = ("prompt", "chosen", "rejected")
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "sequence", "pair_ids")  # each int32 (B, seq_len)
_EXAMPLE = ('{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}, or with lists of chat messages: {"prompt": '
            '[{"role": "user", "content": "2 + 2?"}], "chosen": [{"role": "assistant", "content": "4"}], '
            '"rejected": [{"role": "assistant", "content": "5"}]}')
_READER = "objective=dpo"

Pair = tuple[packed.Example, packed.Example]  # (chosen, rejected): token ids and the mask of completion tokens


def pair_slots(seq_len: int) -> int:
    """How many pairs a row's arrays have room for: `pair_ids`' columns and the loss's (B, K) pair arrays."""
    return seq_len // 2


class PreferenceRows(packed.PackedRows):
    """Rows of whole pairs: packed rows (tokens and flags; each sequence one example) and `pairs` (R, K) int32,
    the id of each row's k-th pair, -1 past the last."""

    def __init__(self, rows: packed.PackedRows, pairs: np.ndarray):
        super().__init__(rows.tokens, rows.flags, rows.pad_id)
        self.pairs = pairs
        # The repr names the content, pairs included (their ids index the reference's cache), as PackedRows' does.
        digest = hashlib.blake2b(self._digest.encode(), digest_size=8)
        digest.update(np.ascontiguousarray(pairs))
        self._digest = digest.hexdigest()

    def batch(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The rows `index` (n,) as a batch (module docstring); index -1 is an empty row (padding only)."""
        index = np.asarray(index)
        batch = super().batch(index)
        learn = batch.pop("loss_mask").astype(bool)  # (n, T): completion targets, never a sequence's first token
        # A learnt target is not its sequence's first token, so it shares its input's segment: ids count from 1.
        batch["sequence"] = np.where(learn, batch["segment_ids"] - 1, -1).astype(np.int32)
        pair_ids = np.full(batch["inputs"].shape, -1, np.int32)  # (n, T)
        k = self.pairs.shape[1]
        pair_ids[:, :k] = np.where((index >= 0)[:, None], self.pairs[index], -1)
        batch["pair_ids"] = pair_ids
        return batch

    def __repr__(self) -> str:
        return f"PreferenceRows(rows={len(self)}, row_len={self.row_len}, blake2b={self._digest})"


@dataclasses.dataclass(frozen=True)
class PreferenceData:
    """Training and held-out pairs packed into rows, and what reading them found."""

    train: PreferenceRows
    val: PreferenceRows
    pairs: tuple[int, int]  # (train, validation)
    tokens: tuple[int, int]  # of both sequences of the pairs, after truncation
    truncated: int  # pairs with a sequence longer than max_len, cut to it
    dropped: int  # pairs whose prompt alone fills max_len

    @property
    def num_pairs(self) -> int:
        """Every pair's id is below this: the rows of the reference's cached log-probabilities."""
        return sum(self.pairs)

    def describe(self) -> str:
        """One line for the start of a run."""
        max_len = (self.train.row_len) // 2
        cut = "".join(f", {n:,} {what}" for n, what in (
            (self.truncated, f"cut to {max_len} tokens a sequence"),
            (self.dropped, f"dropped (the prompt fills {max_len} tokens)")) if n)
        return (f"{self.pairs[0]:,} train / {self.pairs[1]:,} validation preference pairs ({corpus.held_out_rule()})"
                f"{cut}, packed into "
                f"{len(self.train):,} / {len(self.val):,} rows of {self.train.row_len} tokens "
                f"({self.tokens[0]:,} / {self.tokens[1]:,} tokens)")


def load_preferences(path: str, tokenizer: Tokenizer, *, seq_len: int, val_percent: float) -> PreferenceData:
    """Reads, encodes, truncates, splits and packs the pairs at `path` into rows of `seq_len + 1` tokens."""
    encoder = _PairEncoder(tokenizer)
    row_len = seq_len + 1
    max_len = row_len // 2
    names, pairs, truncated, dropped = [], [], 0, 0
    for name, where, record in sft.read_records(path, _EXAMPLE, _READER):
        pair, prompt_len = encoder.encode(record, where)
        if prompt_len >= max_len:  # keep_start would leave no completion token
            dropped += 1
            continue
        truncated += any(len(ids) > max_len for ids, _ in pair)
        names.append(name)
        pairs.append(tuple((ids[:max_len], learn[:max_len]) for ids, learn in pair))
    if len(pairs) < 2:
        raise UserError(
            f"data.path={path!r} holds {len(pairs)} usable preference pair(s)"
            f"{f', after dropping {dropped} whose prompt fills {max_len} tokens' if dropped else ''}: too few to "
            f"train on and hold some out for validation. Expected one JSON record per line, e.g. {_EXAMPLE}. Fix: "
            "point data.path at more pairs" + (", or raise data.seq_len." if dropped else "."))
    if truncated or dropped:
        warnings.warn(
            f"Of {len(pairs) + dropped} preference pairs, {truncated} have a sequence (prompt + completion) longer "
            f"than (data.seq_len + 1) // 2 = {max_len} tokens, cut to that, and {dropped} were dropped because the "
            "prompt alone fills it; raise data.seq_len to keep them whole.", stacklevel=2)
    is_val = corpus.held_out(names, val_percent, at_least=corpus.held_out_minimum(val_percent))
    ids = np.arange(len(pairs))
    splits = [[i for i in ids if is_val[i] == held] for held in (False, True)]
    rows = [_pack([pairs[i] for i in split], split, row_len, seq_len, tokenizer) for split in splits]
    return PreferenceData(
        train=rows[0], val=rows[1], pairs=(len(splits[0]), len(splits[1])),
        tokens=tuple(sum(len(c) + len(r) for (c, _), (r, _) in (pairs[i] for i in split)) for split in splits),
        truncated=truncated, dropped=dropped)


def _pack(pairs: Sequence[Pair], ids: Sequence[int], row_len: int, seq_len: int,
          tokenizer: Tokenizer) -> PreferenceRows:
    """`pairs` (their ids `ids`) packed into rows, each pair's chosen then rejected sequence."""
    rows = packed.best_fit([len(c) + len(r) for (c, _), (r, _) in pairs], row_len)
    k = pair_slots(seq_len)
    assert max(len(members) for members in rows) <= k, "a pair takes at least 4 tokens"
    filled = packed.fill([[seq for i in members for seq in pairs[i]] for members in rows], row_len,
                         pad_id=tokenizer.pad_id, dtype=tokenizer.dtype)
    table = np.full((len(rows), k), -1, np.int32)  # (R, K)
    for r, members in enumerate(rows):
        table[r, : len(members)] = [ids[i] for i in members]
    return PreferenceRows(filled, table)


class _PairEncoder:
    """A record -> ((chosen, rejected), prompt length in tokens), as TRL's DPOTrainer tokenizes it."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.template = LazyTemplate(
            tokenizer, "a conversational pair (lists of messages)",
            "post-train a model imported with its template (`systolic convert from-hf MODEL runs/NAME`), or write "
            "the pairs as strings.")

    def encode(self, record: dict[str, Any], where: str) -> tuple[Pair, int]:
        missing = [f for f in FIELDS if f not in record]
        if missing:
            raise _bad_pair(where, f"has no `{missing[0]}` field (its keys: {sorted(record)})")
        values = [record[f] for f in FIELDS]
        if all(isinstance(v, str) for v in values):
            empty = next((f for f, v in zip(FIELDS, values, strict=True) if not v.strip()), None)
            if empty:
                raise _bad_pair(where, f"has an empty `{empty}`")
            return self._text(*values, where)
        # The prompt's form (text or messages) is the pair's: the field that breaks it is the one named.
        text = isinstance(values[0], str)
        for field, value in zip(FIELDS, values, strict=True):
            if text and not isinstance(value, str):
                raise _bad_pair(where, f"has a `{field}` that is a JSON {json_kind(value)} ({value!r:.40}), but its "
                                "`prompt` is a string, so `chosen` and `rejected` must be non-empty strings too")
            if not text and not _is_messages(value):
                raise _bad_pair(where, f"has a `{field}` that is neither a non-empty string (as the other fields "
                                "must then be) nor a non-empty list of chat messages with a string `role`")
        return self._conversation(*values, where)

    def _text(self, prompt: str, chosen: str, rejected: str, where: str) -> tuple[Pair, int]:
        tok = self.tokenizer
        eot = np.array([tok.eot_id], tok.dtype)
        try:
            head = tok.encode(prompt)
            whole = [np.concatenate([tok.encode(prompt + c), eot]) for c in (chosen, rejected)]
        except UserError as error:  # text that is not Unicode (a lone surrogate from a JSON escape): say where
            raise UserError(f"{where}: {error}") from None
        return self._split(head, whole)

    def _conversation(self, prompt: list, chosen: list, rejected: list, where: str) -> tuple[Pair, int]:
        template = self.template(where)
        try:
            head = template.encode(prompt, add_generation_prompt=True)
            return self._split(head, [template.encode(prompt + c) for c in (chosen, rejected)])
        except UserError as error:  # the template refused this conversation: say which one
            raise UserError(f"{where}: {error}") from None

    @staticmethod
    def _split(head: np.ndarray, whole: list[np.ndarray]) -> tuple[Pair, int]:
        """TRL's split: the prompt is the longest start that the prompt's ids share with both sequences (at least
        one token, the one no completion token can be scored from)."""
        prompt_len = max(1, min(_common_prefix(head, ids) for ids in whole))
        pair = tuple((ids, np.arange(len(ids)) >= prompt_len) for ids in whole)
        return pair, prompt_len


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


def _bad_pair(where: str, problem: str) -> UserError:
    return UserError(f"{where} {problem}. Expected one preference pair per line, {_EXAMPLE}. Fix: repair or remove "
                     "that line.")
