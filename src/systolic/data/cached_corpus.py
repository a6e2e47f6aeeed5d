"""A raw `data.path` (text file, folder, .jsonl, .parquet; empty: the standard library) tokenized once, then cached.

The cached tokens are the in-memory path's own (`corpus.read_documents`, `corpus.split_documents`,
`text.encode_documents`), written in the prepared layout (prepared.py) to `cache_root()/data/<key>`. The key
hashes everything that decides them: each document's name and text as read, data.max_bytes, data.val_percent,
the tokenizer's digest, the field read from .jsonl/.parquet rows and this format's version. A start with the same
key opens the entry (read window by window) instead of tokenizing. The documents are still read at every start: hashing
them is cheap next to tokenizing, and a key on mtimes would miss a same-second edit.

Two processes of one host (`systolic launch`) that miss together both tokenize, each into its own temporary
folder beside the entry, and rename it into place; the second rename fails on the first one's entry, and the
second process discards its copy and reads the first one's, so the entry is always whole and there is one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from systolic.data import corpus, prepare, prepared, text
from systolic.data.cache import cache_root
from systolic.data.corpus import Document
from systolic.data.prepared import SPLITS, PreparedDataset
from systolic.data.tokenizer import Tokenizer
from systolic.errors import UserError

FORMAT_VERSION = 2  # raise when what is written, or how the key is made, changes: old entries are then never read
# 2: corpus.split_documents never holds out more than half of the text
FIELD = "text"  # the field of .jsonl rows and the column of .parquet files that read_documents takes


def load(path: str, *, max_bytes: int, val_percent: float, tokenizer: Tokenizer) -> tuple[PreparedDataset, str]:
    """The corpus at `path` as a prepared dataset in the cache, tokenized now only if it is not there yet.

    Returns the dataset and a one-line note for the start-up output saying where the tokens came from."""
    docs = corpus.read_documents(path, max_bytes=max_bytes)
    key = corpus_key(docs, max_bytes=max_bytes, val_percent=val_percent,
                     tokenizer_sha256=prepared.tokenizer_digest(tokenizer.name))
    entry = cache_root() / "data" / key
    redone = ""
    if entry.exists():
        dataset, problem = _open_checked(entry)
        if dataset is not None:
            note = _note(docs, val_percent)
            return dataset, f"corpus: tokens read from the cache {entry} (not tokenized again)" + note
        # The cache is ours, not the user's data: a damaged entry is made again, not an error.
        shutil.rmtree(entry, ignore_errors=True)
        redone = f"the cached copy failed its check ({problem}) and was prepared again; "
    start = time.perf_counter()
    _write_entry(entry, corpus.split_documents(docs, val_percent), tokenizer=tokenizer, val_percent=val_percent,
                 source=str(corpus.stdlib_dir() if not path else Path(path).expanduser().resolve()))
    seconds = time.perf_counter() - start
    dataset, problem = _open_checked(entry)
    if dataset is None:
        raise UserError(
            f"The cache entry {entry}, just written, fails its check ({problem}): the disk under the cache loses "
            f"writes. Fix: set SYSTOLIC_CACHE to a folder on another disk, or remove {entry} and run again."
        )
    return dataset, f"corpus: {redone}tokenized in {seconds:.2f} s and cached in {entry}" + _note(docs, val_percent)


def _note(docs: Sequence[Document], val_percent: float) -> str:
    note = corpus.split_note(docs, val_percent)
    return f"\n{note}" if note else ""


def corpus_key(docs: Sequence[Document], *, max_bytes: int, val_percent: float, tokenizer_sha256: str) -> str:
    """32 hex digits naming the tokens that these documents and settings give."""
    settings = {"format": FORMAT_VERSION, "prepared_version": prepared.VERSION, "max_bytes": max_bytes,
                "val_percent": val_percent, "tokenizer_sha256": tokenizer_sha256, "field": FIELD}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for doc in docs:
        # Length-prefixed, so no two different lists of (name, text) hash the same stream of bytes.
        for part in (doc.name.encode("utf-8", "surrogatepass"), doc.text.encode("utf-8")):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()[:32]


def _write_entry(entry: Path, split: tuple[list[Document], list[Document]], *, tokenizer: Tokenizer,
                 val_percent: float, source: str) -> None:
    """Tokenizes both splits in memory as training always did, writes them beside `entry` and renames them into place."""
    encoded = []
    for docs in split:
        tokens, lengths = text.encode_with_lengths(docs, tokenizer)
        encoded.append((tokens, lengths, sum(len(d.text.encode("utf-8")) for d in docs)))
    _remove_abandoned(entry.parent)
    partial = entry.with_name(f"{entry.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}@{socket.gethostname()}")
    try:
        partial.mkdir(parents=True)
        prepare.write_encoded(partial, encoded, tokenizer=tokenizer, source=source, val_percent=val_percent,
                              field=FIELD)
        os.rename(partial, entry)  # fails when another process's entry is already there: theirs is kept
    except OSError as error:
        if not (entry / prepared.INDEX_FILE).is_file():
            raise UserError(
                f"The corpus could not be cached in {entry.parent} ({error}). Training reads a raw data.path from "
                "that cache, where it is tokenized once. Fix: free space there, or set SYSTOLIC_CACHE to a writable "
                "folder with room for about twice the corpus."
            ) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _open_checked(entry: Path) -> tuple[PreparedDataset | None, str]:
    """The entry opened, or None and what is wrong with it."""
    try:
        dataset = PreparedDataset.open(entry, verify=False)
    except UserError:
        return None, f"{prepared.INDEX_FILE} unreadable"
    try:
        problem = dataset.damage(trust_verified=True)
        for split in SPLITS:  # the baseline's counts, which the shard checksums do not cover
            if not problem and int(dataset.unigram(split).sum()) != dataset.index["splits"][split]["tokens"]:
                problem = f"{split} unigram counts do not add up to its tokens"
    except UserError as error:  # an unreadable unigram table (safe_npy says why)
        problem = str(error)
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem = f"{type(error).__name__}: {error}"
    return (None, problem) if problem else (dataset, "")


def _remove_abandoned(folder: Path) -> None:
    """Removes temporary folders left by processes of this host that were killed while writing an entry."""
    host = socket.gethostname()
    for partial in folder.glob("*.partial-*@*"):
        pid, _, rest = partial.name.rpartition(".partial-")[2].partition("-")
        if rest.rpartition("@")[2] != host or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(partial, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's
