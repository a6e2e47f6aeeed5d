"""Supervised fine-tuning data (lm's data.format=chat): records -> token ids and the mask of tokens to learn, packed.

`data.path` is a .jsonl file (or .jsonl.gz), or a folder of them read in name order; each line is one record:

- `{"messages": [...]}`, rendered with the chat template kept beside the run's tokenizer.json by
  `ChatTemplate.encode_with_mask`: the tokens to learn are the assistant messages', each through the end-of-turn
  token after it; a conversation without an assistant message is skipped and counted.
- `{"prompt": "...", "completion": "..."}`, plain text that the chat template never touches (TRL's rule): the
  prompt's ids, then the completion's tokenized on their own and the end-of-document id, the tokens to learn.

Each example is named `file:line` and held out for validation by the stable hash of its name (`corpus.held_out`).
An example longer than a row (data.seq_len + 1 tokens) is cut to a row's length and counted (TRL truncates too); the
examples are then packed whole into rows (data/packed.py). The records in full: docs/design-notes.md, this module's
section.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from systolic.data import corpus, packed
from systolic.data.tokenizer import Tokenizer
from systolic.data.chat import LazyTemplate
from systolic.errors import UserError

SUFFIXES = (".jsonl", ".jsonl.gz")
# Bounds on one record. Finding the assistant turns renders and tokenizes every prefix of a conversation, so its
# cost grows with the square of its messages (20,000 messages ran for minutes); a row holds data.seq_len + 1
# tokens, so a conversation of hundreds of turns is cut long before its end anyway. A line is read whole.
MAX_MESSAGES = 512
MAX_RECORD_BYTES = 16 << 20
_EXAMPLE = ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]} or '
            '{"prompt": "2 + 2 =", "completion": " 4"}')


@dataclasses.dataclass(frozen=True)
class ChatCorpus:
    """Training and held-out examples packed into rows, and what reading them found."""

    train: packed.PackedRows
    val: packed.PackedRows
    examples: tuple[int, int]  # (train, validation)
    tokens: tuple[int, int]  # of the examples, after truncation
    learn_tokens: tuple[int, int]  # the tokens to learn: the loss's terms
    truncated: int  # examples longer than a row, cut to fit
    skipped: int  # conversations without an assistant message

    def describe(self) -> str:
        """One line for the start of a run."""
        dropped = "".join(f", {n:,} {what}" for n, what in ((self.truncated, "cut to a row"),
                                                           (self.skipped, "skipped without an assistant message")) if n)
        return (f"{self.examples[0]:,} train / {self.examples[1]:,} validation examples ({corpus.held_out_rule()})"
                f"{dropped}, packed into "
                f"{len(self.train):,} / {len(self.val):,} rows of {self.train.row_len} tokens; "
                f"{self.learn_tokens[0]:,} / {self.learn_tokens[1]:,} of their {self.tokens[0]:,} / {self.tokens[1]:,} "
                "tokens to learn")


def load_chat_corpus(path: str, tokenizer: Tokenizer, *, seq_len: int, val_percent: float) -> ChatCorpus:
    """Reads, encodes, splits and packs the records at `path` into rows of `seq_len + 1` tokens. The last result is
    kept while its files are unchanged: a run sizes its batch from it (lm/resolve.py), then trains on it."""
    global _last
    key = (_signature(path), tokenizer.name, seq_len, val_percent)
    if _last is not None and _last[0] == key and key[0] is not None:
        return _last[1]
    data = _load(path, tokenizer, seq_len=seq_len, val_percent=val_percent)
    _last = (key, data)
    return data


_last: tuple[tuple, ChatCorpus] | None = None  # load_chat_corpus's last (key, result)


def _signature(path: str) -> tuple | None:
    """The files at `path` with their sizes and modification times; None when they cannot be listed."""
    root = Path(path).expanduser()
    try:
        files = corpus.list_files(root, suffixes=SUFFIXES) if root.is_dir() else [root]
        return tuple((str(f.absolute()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    except (OSError, UserError):
        return None


def _load(path: str, tokenizer: Tokenizer, *, seq_len: int, val_percent: float) -> ChatCorpus:
    encoder = _Encoder(tokenizer)
    row_len = seq_len + 1
    names, examples, truncated = [], [], 0
    for name, where, record in read_records(path):
        example = encoder.encode(record, where)
        if example is None:
            continue
        ids, learn = example
        truncated += len(ids) > row_len
        names.append(name)
        examples.append((ids[:row_len], learn[:row_len]))
    if len(examples) < 2:
        skipped = (f", after skipping {encoder.skipped} conversation(s) without an assistant message"
                   if encoder.skipped else "")
        raise UserError(
            f"data.path={path!r} holds {len(examples)} usable example(s){skipped}: too few to train on and hold some "
            f"out for validation. Expected one JSON record per line, e.g. {_EXAMPLE}. Fix: point data.path at more "
            "records."
        )
    if truncated:
        warnings.warn(f"{truncated} of {len(examples)} examples are longer than data.seq_len + 1 = {row_len} tokens "
                      "and were cut to fit, losing what follows; raise data.seq_len to keep them whole.", stacklevel=2)
    if encoder.skipped:
        warnings.warn(f"skipped {encoder.skipped} conversation(s) without an assistant message (e.g. "
                      f"{encoder.first_skipped}): they have no tokens to learn.", stacklevel=2)
    is_val = corpus.held_out(names, val_percent, at_least=corpus.held_out_minimum(val_percent))
    splits = [[e for e, v in zip(examples, is_val, strict=True) if v == held] for held in (False, True)]
    # An example's first token is never learnt (data/packed.py): count what the loss will see.
    learn_tokens = tuple(sum(int(learn[1:].sum()) for _, learn in split) for split in splits)
    for split, count in zip(("training", "held-out"), learn_tokens, strict=True):
        if not count:
            raise UserError(
                f"The {split} examples of data.path={path!r} have no tokens to learn left after truncation to "
                f"data.seq_len + 1 = {row_len} tokens (prompts fill the rows). Fix: raise data.seq_len, or shorten "
                "the prompts."
            )
    rows = [packed.pack(split, row_len, pad_id=tokenizer.pad_id, dtype=tokenizer.dtype) for split in splits]
    return ChatCorpus(
        train=rows[0], val=rows[1],
        examples=(len(splits[0]), len(splits[1])),
        tokens=tuple(sum(len(ids) for ids, _ in split) for split in splits),
        learn_tokens=learn_tokens,
        truncated=truncated, skipped=encoder.skipped,
    )


def read_records(path: str, example: str = _EXAMPLE, reader: str = "data.format=chat",
                 ) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(name `file:line`, where to point errors `path line N`, record) of every non-empty line at `path`; errors
    name the `reader` and show `example`, a line of the kind it reads."""
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"data.path={path!r} does not exist. Expected a .jsonl file of records, or a folder of "
                        f"them, e.g. lines like {example}. Fix: correct the path.")
    files = corpus.list_files(root, suffixes=SUFFIXES) if root.is_dir() else [root]
    if not files or not all(f.name.lower().endswith(SUFFIXES) for f in files):
        found = "holds no .jsonl files" if root.is_dir() else "is not a .jsonl file"
        raise UserError(f"data.path={path!r} {found}; {reader} reads one JSON record per line from .jsonl (or "
                        f".jsonl.gz) files, e.g. {example}. Fix: point data.path at such a file or folder"
                        + (", or set data.format=text to train on plain text." if reader == "data.format=chat" else "."))
    for file in files:
        name = file.relative_to(root).as_posix() if root.is_dir() else file.name
        opener = gzip.open if file.name.lower().endswith(".gz") else open
        with opener(file, "rb") as lines:
            for number, raw in enumerate(iter(lambda: lines.readline(MAX_RECORD_BYTES + 1), b""), start=1):
                where = f"{file} line {number}"
                if len(raw) > MAX_RECORD_BYTES:
                    raise _bad_record(where, f"is longer than {MAX_RECORD_BYTES >> 20} MiB, more than one training "
                                      "example can use (a row holds data.seq_len + 1 tokens)", example)
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, a 5,000-digit number, deep nesting
                    raise _bad_record(where, f"is not valid JSON ({error})", example) from None
                if not isinstance(record, dict):
                    raise _bad_record(where, f"holds a JSON {type(record).__name__}, not an object", example)
                yield f"{name}:{number}", where, record


class _Encoder:
    """A record -> (ids, mask of tokens to learn), or None for a conversation without an assistant message."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.template = LazyTemplate(
            tokenizer, "a conversation (`messages`)",
            "fine-tune a model imported from a Hugging Face folder that has its template (`systolic convert from-hf "
            "MODEL runs/NAME`, then init.from=runs/NAME), copy the model's chat_template.jinja and "
            "tokenizer_config.json beside the tokenizer.json, or write the records as prompt/completion text.")
        self.skipped, self.first_skipped = 0, ""

    def encode(self, record: dict[str, Any], where: str) -> packed.Example | None:
        has_messages, has_prompt = "messages" in record, "prompt" in record or "completion" in record
        if has_messages and has_prompt:
            raise _bad_record(where, "has both `messages` and `prompt`/`completion`, so which to learn is ambiguous")
        if has_messages:
            return self._conversation(record["messages"], where)
        if has_prompt:
            return self._prompt_completion(record, where)
        raise _bad_record(where, f"has neither `messages` nor `prompt` and `completion` (its keys: {sorted(record)})")

    def _conversation(self, messages: Any, where: str) -> packed.Example | None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise _bad_record(where, "has `messages` that are not a non-empty list of objects with a string `role`")
        if len(messages) > MAX_MESSAGES:
            raise _bad_record(where, f"has {len(messages):,} messages, more than the {MAX_MESSAGES} one conversation may "
                              "hold (each turn is rendered with all before it, so the cost grows with their square, and "
                              "a row of data.seq_len + 1 tokens would keep only the first few); split it into several "
                              "conversations")
        try:
            ids, learn = self.template(where).encode_with_mask(messages)
        except UserError as error:  # the template refused this conversation: say which one
            raise UserError(f"{where}: {error}") from None
        if not learn.any():
            self.skipped += 1
            self.first_skipped = self.first_skipped or where
            return None
        return ids, learn

    def _prompt_completion(self, record: dict[str, Any], where: str) -> packed.Example:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise _bad_record(where, "needs `prompt` and `completion` both strings (for conversations, use `messages`)")
        tok = self.tokenizer
        head = tok.encode(prompt)
        tail = np.concatenate([tok.encode(completion, add_special_tokens=False), np.array([tok.eot_id], tok.dtype)])
        return np.concatenate([head, tail]), np.concatenate([np.zeros(len(head), bool), np.ones(len(tail), bool)])


def _bad_record(where: str, problem: str, example: str = _EXAMPLE) -> UserError:
    return UserError(f"{where} {problem}. Expected one JSON object per line, {example}. Fix: repair or remove "
                     "that line.")
