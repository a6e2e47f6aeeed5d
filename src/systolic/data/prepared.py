"""A prepared dataset on disk (written by `systolic data prepare`, see prepare.py) and how training reads it.

Layout of DIR: `index.json` (what is in it, with a SHA-256 per shard), per split (`train`, `validation`) the
shards `<split>-00000.bin`, ... of `shard_tokens` raw little-endian tokens each (the last one shorter), every
document followed by the tokenizer's end-of-document id as `text.encode_documents` does; `<split>-docs.npy`
(int64, documents + 1 token offsets: document i is tokens [offsets[i], offsets[i + 1])); `<split>-unigram.npy`
(int64 count of each id, for the unigram baseline); and `tokenizer.json`, a copy of the BPE it was made with.
Training reads the shards window by window (`os.pread`), so start-up memory does not grow with the corpus.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from systolic import safe_npy
from systolic.data import cache
from systolic.data.tokenizer import ByteTokenizer, Tokenizer, tokenizer_file
from systolic.errors import UserError

INDEX_FILE = "index.json"
FORMAT = "systolic-prepared-tokens"
VERSION = 1
SPLITS = ("train", "validation")
_HASH_CHUNK = 1 << 24


def is_prepared(path: str) -> bool:
    """Whether `path` is a prepared dataset's folder (it holds an index.json)."""
    return bool(path) and (Path(path).expanduser() / INDEX_FILE).is_file()


def tokenizer_digest(spec: str) -> str:
    """"byte" for the byte tokenizer, else the SHA-256 of the tokenizer.json that `spec` names."""
    if spec == ByteTokenizer.name:
        return spec
    return hashlib.sha256(tokenizer_file(spec).read_bytes()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ShardedTokens:
    """One split's tokens across its shards: `len()` and integer-array indexing, like a 1-D array.

    All shards but the last hold exactly `shard_tokens` tokens, so a token's shard is its index // shard_tokens.
    Reads are `os.pread`s of each run of consecutive indices (a window is one run, or two across a shard's end), not
    a memory map: a mapped file's touched pages count as the process's resident memory, and the kernel maps ~64 KB
    around each one, so a long run over a large corpus would grow its RSS towards the corpus size
    (benchmarks/studies/data_startup.py measured +190 MB after 103 batches of 32 windows on 3 GB).
    """

    def __init__(self, files: list[Path], sizes: list[int], shard_tokens: int, dtype: np.dtype, digest: str):
        self._files = [str(f) for f in files]
        self._fds: list[int] = []
        self._length = sum(sizes)
        self._shard_tokens = shard_tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")  # shards are little-endian on every host
        self.content_digest = digest  # names the content in Grain's repr without reading every token

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index) -> np.ndarray:
        index = np.asarray(index)
        flat = index.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self._length):
            raise IndexError(f"token index out of range [0, {self._length})")
        if not self._fds:  # opened on first read; POSIX_FADV_RANDOM: no readahead for scattered windows
            self._fds = [os.open(f, os.O_RDONLY) for f in self._files]
            for fd in self._fds:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        out = np.empty(flat.shape, self.dtype)
        shard = flat // self._shard_tokens
        # runs of consecutive indices within one shard: [starts[i], starts[i + 1])
        starts = np.flatnonzero(np.concatenate([[True], (np.diff(flat) != 1) | (np.diff(shard) != 0)]))
        size = self.dtype.itemsize
        for lo, hi in zip(starts.tolist(), [*starts[1:].tolist(), len(flat)]):
            s = int(shard[lo])
            data = os.pread(self._fds[s], (hi - lo) * size, (int(flat[lo]) - s * self._shard_tokens) * size)
            out[lo:hi] = np.frombuffer(data, self.dtype)
        return out.reshape(index.shape)

    def __getstate__(self) -> dict:
        return self.__dict__ | {"_fds": []}  # a copy or another process opens its own descriptors

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", []):
            os.close(fd)

    def __repr__(self) -> str:
        return f"ShardedTokens(tokens={self._length}, sha256={self.content_digest})"


class ConcatTokens:
    """Several token sources end to end, with the same `len()` and integer-array indexing (mixtures' validation)."""

    def __init__(self, parts: list[ShardedTokens]):
        self._parts = parts
        self._starts = np.cumsum([0] + [len(p) for p in parts])  # (parts + 1,)
        self.dtype = np.result_type(*(p.dtype for p in parts))
        self.content_digest = hashlib.sha256(" ".join(p.content_digest for p in parts).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index) -> np.ndarray:
        index = np.asarray(index)
        part = np.searchsorted(self._starts, index, side="right") - 1
        out = np.empty(index.shape, self.dtype)
        for p in np.unique(part):
            where = part == p
            out[where] = self._parts[p][index[where] - self._starts[p]]
        return out

    def __repr__(self) -> str:
        return f"ConcatTokens(tokens={len(self)}, sha256={self.content_digest})"


@dataclasses.dataclass(frozen=True)
class PreparedDataset:
    root: Path
    index: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path, *, verify: bool = True, trust_verified: bool = False) -> PreparedDataset:
        """Reads DIR/index.json; with `verify`, checks every shard's size and SHA-256 (UserError if one fails).

        `trust_verified` (training's start) skips reading the shards that passed before and are unchanged since
        (cache.py says what unchanged means); `systolic data info` reads them all."""
        root = Path(path).expanduser()
        try:
            index = json.loads((root / INDEX_FILE).read_text(encoding="utf-8"))
            ok = index.get("format") == FORMAT and index.get("version") == VERSION
        except (OSError, ValueError, RecursionError, AttributeError):  # ValueError: bad UTF-8 or JSON
            ok = False
        if not ok:
            raise UserError(
                f"{root / INDEX_FILE} is not the index of a prepared dataset (format {FORMAT!r}, version {VERSION}). "
                f"Fix: prepare the data again with `systolic data prepare SRC --out {root}` into a new folder."
            )
        if problem := index_problem(index):
            raise UserError(
                f"{root / INDEX_FILE} says it is a prepared dataset's index, but {problem}, so the data cannot be "
                f"read from it (edited by hand, or written by something else). Fix: prepare the data again with "
                f"`systolic data prepare SRC --out NEW_DIR`, or restore the folder from a good copy."
            )
        dataset = cls(root, index)
        if verify:
            dataset.verify(trust_verified=trust_verified)
        return dataset

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.index["dtype"])

    def shards(self, split: str) -> list[dict[str, Any]]:
        return self.index["splits"][split]["shards"]

    def verify(self, *, trust_verified: bool = False) -> None:
        """Every shard is present, of the recorded size and SHA-256; raises one UserError naming the first bad one.

        Shards that pass are remembered in the cache (cache.remember_shards); with `trust_verified`, those remembered
        and unchanged are not read again, so a training start does not grow with the corpus."""
        problem = self.damage(trust_verified=trust_verified)
        if problem:
            raise UserError(
                f"The prepared dataset {self.root} is damaged: {problem}. Training on it would read wrong tokens. Fix: "
                f"prepare it again (`systolic data prepare {self.index['source']} --out NEW_DIR`) or restore the "
                "folder from a good copy."
            )

    def damage(self, *, trust_verified: bool = False) -> str | None:
        """What is wrong with the first bad shard ("shard X is missing", ...), or None when all pass."""
        recorded = {self.root / s["file"]: s for split in SPLITS for s in self.shards(split)}
        trusted = cache.trusted_shards(self.root, {f: s["sha256"] for f, s in recorded.items()}) if trust_verified else set()
        checked = {}
        for file, shard in recorded.items():
            expected = shard["tokens"] * self.dtype.itemsize
            seen = cache.shard_stat(file) if file.is_file() else None  # before reading: a later change shows
            if seen is None or seen["size"] != expected:
                return f"shard {file.name} " + ("is missing" if seen is None else
                                                f"has {seen['size']:,} bytes where the index records {expected:,}")
            if file not in trusted and file_sha256(file) != shard["sha256"]:
                return f"shard {file.name} fails its SHA-256 check (its bytes changed since it was written)"
            checked[file] = {**seen, "sha256": shard["sha256"]}
        if len(trusted) < len(recorded):  # something was read: remember it for the next start
            cache.remember_shards(self.root, checked)
        return None

    def tokens(self, split: str) -> ShardedTokens:
        shards = self.shards(split)
        digest = hashlib.sha256("".join(s["sha256"] for s in shards).encode()).hexdigest()[:16]
        return ShardedTokens([self.root / s["file"] for s in shards], [s["tokens"] for s in shards],
                             self.index["shard_tokens"], self.dtype, digest)

    def unigram(self, split: str) -> np.ndarray:
        """The split's (vocab_size,) int64 count of each id; a UserError naming the file when it is anything else."""
        recorded = self.index["splits"][split]
        path = self.root / recorded["unigram"]
        vocab = self.index["tokenizer"]["vocab_size"]
        fix = f"prepare the data again (`systolic data prepare {self.index['source']} --out NEW_DIR`)."
        expected = f"the {split} split's unigram table, a .npy of {vocab} int64 counts"
        counts = safe_npy.read_array(path, kind="i", shape=(vocab,), expected=expected, fix=fix)
        if counts.min(initial=0) < 0 or int(counts.sum(dtype=np.float64)) != recorded["tokens"]:
            raise UserError(f"Could not use {path}: its counts are negative or do not add up to the {recorded['tokens']:,} "
                            f"tokens {INDEX_FILE} records for the {split} split. Expected {expected}. Fix: {fix}")
        return counts.astype(np.int64)

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """UserError unless `tokenizer` (data.tokenizer's) is the tokenizer the data was prepared with."""
        recorded = self.index["tokenizer"]
        if tokenizer_digest(tokenizer.name) != recorded["sha256"]:
            made_with = "data.tokenizer=byte" if recorded["sha256"] == "byte" else f"the tokenizer {self.root / recorded['file']}"
            raise UserError(
                f"The prepared dataset {self.root} holds token ids of {made_with}, but this run uses data.tokenizer="
                f"{tokenizer.name!r}, a different tokenizer; the model would learn the wrong tokens. Fix: train with "
                f"data.tokenizer={'byte' if recorded['sha256'] == 'byte' else self.root / recorded['file']}, or prepare "
                "the data again with --tokenizer set to the run's tokenizer."
            )

    def describe(self) -> str:
        """What `systolic data info` prints."""
        ix = self.index
        tok = ix["tokenizer"]
        lines = [f"{self.root}: prepared from {ix['source']} (field {ix['field']!r}), {ix['dtype']} tokens, "
                 f"tokenizer {tok['name']} (vocabulary {tok['vocab_size']}, eot {tok['eot_id']}, sha256 {tok['sha256'][:16]})"]
        for split in SPLITS:
            s = ix["splits"][split]
            lines.append(f"  {split}: {s['documents']:,} documents, {s['tokens']:,} tokens, {s['bytes']:,} bytes of text, "
                         f"{len(s['shards'])} shard(s) of <= {ix['shard_tokens']:,} tokens")
        return "\n".join(lines)


# THE INDEX'S SHAPE: what the readers above index into, checked once when the folder is opened ---------------------


def index_problem(index: dict[str, Any]) -> str | None:
    """What is wrong with a parsed index.json's fields ("its splits.train.shards[3] has no 'sha256'"), or None."""
    tokenizer = index.get("tokenizer")
    checks = [
        _field(index, "dtype", str) or (None if _token_dtype(index["dtype"]) else f"its dtype {index['dtype']!r} "
                                        "is not an unsigned integer type of at most 32 bits"),
        _field(index, "shard_tokens", int, positive=True), _field(index, "source", str),
        _field(index, "field", (str, type(None))),
        _field(index, "val_percent", (int, float)), _field(index, "tokenizer", dict),
        *([_field(tokenizer, key, kind, at="tokenizer.") for key, kind in
           (("name", str), ("sha256", str), ("vocab_size", int), ("eot_id", int), ("file", (str, type(None))))]
          if isinstance(tokenizer, dict) else []),
        _field(index, "splits", dict),
    ]
    if problem := next((c for c in checks if c), None):
        return problem
    if tokenizer["vocab_size"] < 1 or not 0 <= tokenizer["eot_id"] < tokenizer["vocab_size"]:
        return f"its tokenizer.vocab_size {tokenizer['vocab_size']} and eot_id {tokenizer['eot_id']} are out of range"
    for split in SPLITS:
        if problem := _split_problem(index["splits"].get(split), f"splits.{split}"):
            return problem
    return None


def _split_problem(split: Any, at: str) -> str | None:
    if not isinstance(split, dict):
        return f"its {at} is missing or not an object"
    checks = [*(_field(split, key, int, at=f"{at}.", positive=False) for key in ("documents", "tokens", "bytes")),
              _field(split, "unigram", str, at=f"{at}.", plain_name=True),
              _field(split, "shards", list, at=f"{at}.")]
    if problem := next((c for c in checks if c), None):
        return problem
    for i, shard in enumerate(split["shards"]):
        if not isinstance(shard, dict):
            return f"its {at}.shards[{i}] is not an object"
        problem = (_field(shard, "file", str, at=f"{at}.shards[{i}].", plain_name=True)
                   or _field(shard, "tokens", int, at=f"{at}.shards[{i}].", positive=False)
                   or _field(shard, "sha256", str, at=f"{at}.shards[{i}]."))
        if problem:
            return problem
    if sum(shard["tokens"] for shard in split["shards"]) != split["tokens"]:
        return f"its {at}.shards do not add up to the split's {split['tokens']} tokens"
    return None


def _field(tree: dict[str, Any], key: str, kind: type | tuple[type, ...], *, at: str = "", positive: bool | None = None,
           plain_name: bool = False) -> str | None:
    """What is wrong with tree[key] (missing, of another type, negative or zero, a path rather than a file name)."""
    if key not in tree:
        return f"it has no {at}{key!r}"
    value = tree[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        return f"its {at}{key} is {json.dumps(value)[:60]}, not of the expected type"
    if positive is not None and (value <= 0 if positive else value < 0):
        return f"its {at}{key} is {value}, not {'positive' if positive else '>= 0'}"
    if plain_name and (Path(value).name != value or value in ("", ".", "..")):
        return f"its {at}{key} {value!r} is not a file name inside the folder"
    return None


def _token_dtype(name: str) -> bool:
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError):
        return False
    return dtype.kind == "u" and dtype.itemsize <= 4
