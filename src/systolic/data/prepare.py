"""`systolic data prepare`: stream a corpus, tokenize it in worker processes, write token shards (prepared.py).

The input is read one record at a time, at most `2 * workers` batches are in flight, and tokens go to the shard
being filled every few MB, so memory grows neither with the corpus nor with the shard size. Everything is written
into OUT.partial and renamed to OUT when complete, so a half-written dataset is never taken for a finished one.
After each complete shard the progress (input records consumed, the tokens already in each split's open shard,
per-document offsets so far) is saved; a rerun of the same command resumes there, cutting the open shards back to
the saved length, and writes the same bytes as a run that was never interrupted.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from systolic import outfile
from systolic.data import corpus
from systolic.data.prepared import FORMAT, INDEX_FILE, SPLITS, VERSION, tokenizer_digest
from systolic.data.tokenizer import ByteTokenizer, Tokenizer, make_tokenizer, tokenizer_file
from systolic.errors import UserError

PROGRESS_FILE = "progress.json"
_BATCH_BYTES = 1 << 20  # text per worker task: large enough to amortise pickling, small enough to stream
_COUNT_CHUNK = 1 << 22
_FLUSH_TOKENS = 1 << 21  # tokens held per split before they go to its open shard (4-8 MB)


@dataclasses.dataclass
class _Split:
    """One split while it is being written."""

    name: str
    pending: list[np.ndarray]  # tokens not yet written to the open shard, in pieces (joined once per flush)
    counts: np.ndarray  # (vocab_size,) int64 occurrences of each id written so far (open shard included)
    open: _OpenShard | None = None  # the shard being filled
    shards: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ends: list[int] = dataclasses.field(default_factory=list)  # document end offsets not yet in <split>-docs.i64
    pending_tokens: int = 0
    documents: int = 0
    tokens: int = 0
    bytes: int = 0


def prepare(src: str, out: Path, *, tokenizer: str = "byte", field: str = "text", val_percent: float = 5.0,
            shard_tokens: int = 1 << 26, workers: int = 0) -> str:
    """Prepares `src` into `out`; returns a one-line summary. `workers=0`: one per CPU core."""
    if not 0 < val_percent < 100 or shard_tokens <= 0 or workers < 0:
        raise UserError(f"--val-percent {val_percent}, --shard-tokens {shard_tokens}, --workers {workers}: expected "
                        "0 < val-percent < 100, shard-tokens > 0 and workers >= 0 (0: one per core).")
    root = Path(src).expanduser()
    if not root.exists():
        raise UserError(f"{src} does not exist. Expected a text file, a folder, a .jsonl(.gz), .parquet or a Hugging "
                        "Face save_to_disk folder. Fix: correct the path.")
    out = outfile.check_folder(Path(out).expanduser(), option="--out")
    if out.exists():
        raise UserError(f"--out {out} already exists. Fix: remove it, or choose another --out.")
    spec = _resolved(tokenizer)
    tok = make_tokenizer(spec)
    settings = _settings(str(root.resolve()), field, val_percent, shard_tokens, spec, tok)
    partial = out.with_name(out.name + ".partial")
    writer = _Writer.resume_or_start(partial, settings, tok)  # outside the try: another run's progress is kept
    try:
        _tokenize_into(writer, corpus.iter_texts(root, field=field), tok, workers or os.cpu_count() or 1)
        writer.finish(tok, spec, field)
    except UserError:
        shutil.rmtree(partial, ignore_errors=True)  # bad input: leave nothing behind
        raise
    os.replace(partial, out)
    t, v = writer.splits
    return (f"prepared {out}: {t.documents:,} train / {v.documents:,} validation documents, {t.tokens:,} / {v.tokens:,} "
            f"tokens in {len(t.shards)} + {len(v.shards)} shard(s)")


def write_encoded(out: Path, splits: list[tuple[np.ndarray, np.ndarray, int]], *, tokenizer: Tokenizer, source: str,
                  val_percent: float, field: str = "text", shard_tokens: int = 1 << 26) -> None:
    """Writes splits that are already encoded into the existing empty folder `out`, in the layout `prepare` writes.

    `splits` holds (tokens, tokens per document, UTF-8 bytes) for train and for validation, the tokens as
    `text.encode_documents` returns them (each document followed by the end-of-document id). The raw-corpus cache
    (cached_corpus.py) writes the in-memory path's own tokens this way, so a cached corpus is the tokens it had.
    """
    spec = _resolved(tokenizer.name)
    writer = _Writer(out, _settings(source, field, val_percent, shard_tokens, spec, tokenizer), tokenizer,
                     resumable=False)
    for split, (tokens, lengths, nbytes) in zip(writer.splits, splits, strict=True):
        writer.append(split, [tokens.astype(tokenizer.dtype, copy=False)], lengths.tolist(), nbytes)
    writer.finish(tokenizer, spec, field)


def _resolved(tokenizer: str) -> str:
    """data.tokenizer / --tokenizer as "byte" or the absolute path of its tokenizer.json (copied into the output)."""
    return tokenizer if tokenizer == ByteTokenizer.name else str(tokenizer_file(tokenizer).resolve())


def _settings(source: str, field: str, val_percent: float, shard_tokens: int, spec: str, tok: Tokenizer) -> dict[str, Any]:
    # progress 2: open shards on disk (1 kept pending tokens in .npy files); a mismatch is refused like any setting
    return {"source": source, "field": field, "val_percent": val_percent, "shard_tokens": shard_tokens,
            "tokenizer_sha256": tokenizer_digest(spec), "dtype": np.dtype(tok.dtype).name, "progress": 2}


def _tokenize_into(writer: _Writer, texts: Iterator[tuple[str, str | None]], tok: Tokenizer, workers: int) -> None:
    last = None
    for _ in range(writer.consumed):  # a resumed run skips what the saved progress holds (read, not tokenized)
        last, _text = next(texts, (None, None))
    if last != writer.last_name:  # files added, removed or renamed before the point where it stopped
        raise UserError(
            f"The input {writer.settings['source']} changed since the interrupted preparation in {writer.partial}: "
            f"its record {writer.consumed} is now {last!r}, not {writer.last_name!r}, so the saved shards do not "
            f"match it. It was removed. Fix: run the command again to prepare from the start."
        )
    batches = _batches(texts)
    if workers == 1:
        for items in batches:
            writer.add(items, _encode(tok, [t for _, t in items]))
        return
    # spawn, not fork: a forked child of a process that already used the tokenizers' thread pool can deadlock. Each
    # worker opens the tokenizer from its spec (its name) itself.
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tok.name,)) as pool:
        in_flight: collections.deque = collections.deque()
        for items in batches:  # ordered, and at most 2 * workers batches held: the input streams
            in_flight.append((items, pool.apply_async(_encode_in_worker, ([t for _, t in items],))))
            if len(in_flight) >= 2 * workers:
                done, result = in_flight.popleft()
                writer.add(done, result.get())
        while in_flight:
            done, result = in_flight.popleft()
            writer.add(done, result.get())


def _batches(texts: Iterator[tuple[str, str | None]]) -> Iterator[list[tuple[str, str | None]]]:
    batch, size = [], 0
    for name, text in texts:
        batch.append((name, text))
        size += len(text or "")
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(tok: Tokenizer, texts: list[str | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(all tokens concatenated, tokens per text, UTF-8 bytes per text); an unreadable text (None) is empty."""
    ids = tok.encode_batch([t or "" for t in texts])
    lengths = np.array([len(i) for i in ids], np.int64)
    nbytes = np.array([len(t.encode("utf-8")) if t else 0 for t in texts], np.int64)
    return (np.concatenate(ids) if ids else np.zeros(0, tok.dtype)).astype(tok.dtype), lengths, nbytes


_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no threads on top
    _worker_tokenizer = make_tokenizer(spec)


def _encode_in_worker(texts: list[str | None]):
    assert _worker_tokenizer is not None
    return _encode(_worker_tokenizer, texts)


class _Writer:
    """Appends documents to the two splits, writes full shards, saves progress after each (when resumable)."""

    def __init__(self, partial: Path, settings: dict[str, Any], tok: Tokenizer, *, resumable: bool = True):
        self.partial, self.settings, self.eot = partial, settings, tok.eot_id
        self.resumable = resumable  # False: written in one go (the raw-corpus cache), no progress to save
        self.dtype = np.dtype(tok.dtype)
        self.splits = [_Split(name, [], np.zeros(tok.vocab_size, np.int64)) for name in SPLITS]
        self.consumed = 0  # input records (documents, empty ones and unreadable files) taken so far
        self.last_name: str | None = None  # the last of them, checked when a run resumes
        self.skipped = 0
        self.saves = 0

    @classmethod
    def resume_or_start(cls, partial: Path, settings: dict[str, Any], tok: Tokenizer) -> _Writer:
        writer = cls(partial, settings, tok)
        progress_file = partial / PROGRESS_FILE
        if not progress_file.is_file():  # nothing saved yet (or never started): start afresh
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            return writer
        progress = json.loads(progress_file.read_text())
        if progress["settings"] != settings:
            raise UserError(
                f"{partial} holds an interrupted preparation with other settings ({progress['settings']}) than this "
                f"one ({settings}). Fix: rerun it with its own settings to finish it, or delete {partial}."
            )
        writer.consumed, writer.skipped, writer.saves = progress["consumed"], progress["skipped"], progress["saves"]
        writer.last_name = progress["last_name"]
        for split, saved in zip(writer.splits, progress["splits"], strict=True):
            split.shards, split.documents, split.tokens, split.bytes = (
                saved["shards"], saved["documents"], saved["tokens"], saved["bytes"])
            split.counts = np.load(partial / saved["counts"])
            _forget_unsaved_shards(partial, split, saved["open_tokens"])
            split.open = _OpenShard.reopen(partial, split, saved["open_tokens"], writer.dtype)
            with (partial / f"{split.name}-docs.i64").open("r+b") as f:  # drop offsets written after the save
                f.truncate(split.documents * 8)
        return writer

    def add(self, items: list[tuple[str, str | None]], encoded: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        tokens, lengths, nbytes = encoded
        ends = np.cumsum(lengths)
        eot = np.array([self.eot], self.dtype)
        for i, (name, text) in enumerate(items):
            self.consumed += 1
            self.last_name = name
            if text is None:
                self.skipped += 1
            if not text:
                continue
            # The same stable name hash as corpus.split_documents, decided per document so it can stream.
            split = self.splits[1 if corpus.is_validation(name, self.settings["val_percent"]) else 0]
            self.append(split, [tokens[ends[i] - lengths[i]: ends[i]], eot], [lengths[i] + 1], int(nbytes[i]))

    def append(self, split: _Split, pieces: list[np.ndarray], lengths: list[int], nbytes: int) -> None:
        """Adds documents to `split`: `pieces` hold their tokens, each document's ending in the end-of-document id,
        `lengths` their token counts (with that id) and `nbytes` their UTF-8 bytes; writes the shards that fill."""
        split.pending += pieces
        for length in lengths:
            split.tokens += int(length)
            split.ends.append(split.tokens)
            split.pending_tokens += int(length)
        split.documents += len(lengths)
        split.bytes += nbytes
        room = self.settings["shard_tokens"] - (split.open.tokens if split.open else 0)
        if split.pending_tokens >= min(room, _FLUSH_TOKENS) and self._flush(split) and self.resumable:
            self._save_progress()

    def _flush(self, split: _Split) -> bool:
        """Writes `split`'s pending tokens to its open shard, closing each shard that fills; True if one did."""
        pending, split.pending, split.pending_tokens = _joined(split, self.dtype), [], 0
        size, closed = self.settings["shard_tokens"], False
        while len(pending):
            if split.open is None:
                split.open = _OpenShard(self.partial, split)
            take = pending[: size - split.open.tokens]
            for start in range(0, len(take), _COUNT_CHUNK):  # bincount widens to int64: a chunk at a time
                split.counts += np.bincount(take[start: start + _COUNT_CHUNK], minlength=len(split.counts))
            split.open.write(take)
            pending = pending[len(take):]
            if split.open.tokens == size:
                _write_shard(self.partial, split)
                closed = True
        return closed

    def _save_progress(self) -> None:
        """Every split's tokens flushed and synced to its open shard, counts under a fresh name, then progress.json
        by rename: a kill at any moment leaves the previous progress or this one, whole."""
        self.saves += 1
        splits = []
        for split in self.splits:
            self._flush(split)  # may fill the other split's shard too; recorded below all the same
            counts = f"counts-{self.saves}-{split.name}.npy"
            _flush_ends(self.partial, split)
            if split.open is not None:
                split.open.sync()
            np.save(self.partial / counts, split.counts)
            splits.append({"shards": split.shards, "documents": split.documents, "tokens": split.tokens,
                           "bytes": split.bytes, "open_tokens": split.open.tokens if split.open else 0,
                           "counts": counts})
        progress = {"settings": self.settings, "consumed": self.consumed, "last_name": self.last_name, "skipped": self.skipped,
                    "saves": self.saves, "splits": splits}
        _write_atomic(self.partial / PROGRESS_FILE, json.dumps(progress).encode())
        for old in self.partial.glob("counts-*.npy"):
            if not old.name.startswith(f"counts-{self.saves}-"):
                old.unlink()

    def finish(self, tok: Tokenizer, spec: str, field: str) -> None:
        empty = [s.name for s in self.splits if not s.documents]
        if empty:
            train, val = self.splits
            raise UserError(
                f"{self.settings['source']} gave {train.documents} training and {val.documents} validation "
                f"document(s) ({self.skipped} unreadable file(s) skipped): the {' and '.join(empty)} split would be "
                "empty. Expected non-empty UTF-8 text files or records with a non-empty "
                f"{field!r} field, enough that --val-percent {self.settings['val_percent']} of them (chosen by a hash "
                "of their names) leaves both splits non-empty. Fix: add documents, or change --val-percent."
            )
        for split in self.splits:
            self._flush(split)
            if split.open is not None and split.open.tokens:  # the last, shorter shard
                _write_shard(self.partial, split)
            _flush_ends(self.partial, split)
            ends = np.fromfile(self.partial / f"{split.name}-docs.i64", np.int64)
            np.save(self.partial / f"{split.name}-docs.npy", np.concatenate([[0], ends]))
            np.save(self.partial / f"{split.name}-unigram.npy", split.counts)
        tok_file = None
        if spec != ByteTokenizer.name:
            tok_file = "tokenizer.json"
            shutil.copyfile(spec, self.partial / tok_file)
        index = {
            "format": FORMAT, "version": VERSION, "source": self.settings["source"], "field": field,
            "dtype": self.settings["dtype"], "shard_tokens": self.settings["shard_tokens"],
            "val_percent": self.settings["val_percent"], "skipped_files": self.skipped,
            "tokenizer": {"name": tok.name if tok_file is None else Path(spec).name, "file": tok_file,
                          "sha256": self.settings["tokenizer_sha256"], "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
            "splits": {s.name: {"documents": s.documents, "tokens": s.tokens, "bytes": s.bytes, "shards": s.shards,
                                "offsets": f"{s.name}-docs.npy", "unigram": f"{s.name}-unigram.npy"}
                       for s in self.splits},
        }
        for split in self.splits:
            if split.open is not None:  # an empty open shard: the split ended exactly at a shard boundary
                split.open.discard()
        for leftover in [self.partial / PROGRESS_FILE, *self.partial.glob("counts-*"),
                         *self.partial.glob("*.i64"), *self.partial.glob("*.tmp")]:
            leftover.unlink(missing_ok=True)  # progress.json exists only once a shard was full
        _write_atomic(self.partial / INDEX_FILE, json.dumps(index, indent=1).encode())
        if self.skipped:
            warnings.warn(f"Skipped {self.skipped} unreadable, binary or non-UTF-8 file(s) in {self.settings['source']}.",
                          stacklevel=2)


def _joined(split: _Split, dtype: np.dtype) -> np.ndarray:
    if len(split.pending) == 1:  # a whole split from write_encoded: no copy of it
        return split.pending[0]
    return np.concatenate(split.pending) if split.pending else np.zeros(0, dtype)


def _flush_ends(partial: Path, split: _Split) -> None:
    with (partial / f"{split.name}-docs.i64").open("ab") as f:
        f.write(np.asarray(split.ends, np.int64).tobytes())
    split.ends = []


def _forget_unsaved_shards(partial: Path, split: _Split, open_tokens: int) -> None:
    """Removes `split`'s shards written after the saved progress; the one that was open at the save (closed since,
    or still open) becomes the open `.tmp` again, to be cut back to its saved length."""
    open_name = f"{split.name}-{len(split.shards):05d}.bin"
    kept = {s["file"] for s in split.shards}
    for file in sorted(partial.glob(f"{split.name}-*.bin")) + sorted(partial.glob(f"{split.name}-*.bin.tmp")):
        if file.name in kept:
            continue
        if open_tokens and file.name == open_name:
            os.replace(file, partial / f"{open_name}.tmp")
        elif not (open_tokens and file.name == f"{open_name}.tmp"):
            file.unlink()


class _OpenShard:
    """The shard being filled, `<split>-NNNNN.bin.tmp`: tokens are appended and hashed as they come."""

    def __init__(self, partial: Path, split: _Split, *, keep_tokens: int = 0, itemsize: int = 0):
        self.name = f"{split.name}-{len(split.shards):05d}.bin"
        self.tmp = partial / f"{self.name}.tmp"
        self.sha = hashlib.sha256()
        self.tokens = keep_tokens
        if keep_tokens:  # resuming: cut what was written after the saved progress, hash what stays
            with self.tmp.open("r+b") as f:
                f.truncate(keep_tokens * itemsize)
            with self.tmp.open("rb") as f:
                while chunk := f.read(_COUNT_CHUNK):
                    self.sha.update(chunk)
        self.file = self.tmp.open("ab" if keep_tokens else "wb")

    @classmethod
    def reopen(cls, partial: Path, split: _Split, tokens: int, dtype: np.dtype) -> _OpenShard | None:
        return cls(partial, split, keep_tokens=tokens, itemsize=dtype.itemsize) if tokens else None

    def write(self, tokens: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(tokens, tokens.dtype.newbyteorder("<"))).cast("B")  # no copy
        self.file.write(data)
        self.sha.update(data)
        self.tokens += len(tokens)

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _write_shard(partial: Path, split: _Split) -> None:
    """Closes `split`'s full (or last) open shard under its final name and records it."""
    shard, split.open = split.open, None
    shard.sync()
    shard.file.close()
    os.replace(shard.tmp, partial / shard.name)
    split.shards.append({"file": shard.name, "tokens": shard.tokens, "sha256": shard.sha.hexdigest()})


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
