"""The data cache: a raw data.path is tokenized once (the same tokens as the in-memory path, so the same losses) and
read from the cache after; a changed byte is a new key; a damaged entry is made again; two processes that miss
together end with one whole entry. Prepared shards that passed their SHA-256 check are not read again at the next
training start, while a changed one is still caught."""

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tiny import LM_CLI_QUIET, TINY_LM

from systolic.cli import main
from systolic.data import cached_corpus, prepare as prepare_mod, prepared
from systolic.data.corpus import read_documents, split_documents, stdlib_dir
from systolic.data.prepare import prepare
from systolic.data.text import encode_documents
from systolic.data.tokenizer import ByteTokenizer

VAL = 30.0
MAX_BYTES = 60_000


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test alone: whether a start hits must not depend on what other tests cached."""
    monkeypatch.setenv("SYSTOLIC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def src(tmp_path) -> Path:
    """~75 kB: the standard library's json package and two more modules, cut to MAX_BYTES."""
    root = tmp_path / "src"
    for file in [*sorted((stdlib_dir() / "json").glob("*.py")), stdlib_dir() / "bisect.py", stdlib_dir() / "heapq.py"]:
        (root / file.parent.name).mkdir(parents=True, exist_ok=True)
        (root / file.parent.name / file.name).write_bytes(file.read_bytes())
    return root


def _load(src: Path):
    return cached_corpus.load(str(src), max_bytes=MAX_BYTES, val_percent=VAL, tokenizer=ByteTokenizer())


def _all(dataset: prepared.PreparedDataset, split: str) -> np.ndarray:
    tokens = dataset.tokens(split)
    return tokens[np.arange(len(tokens))]


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "data").iterdir())


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def test_second_run_reads_the_cache_without_tokenizing_and_gets_the_same_losses(src, cache, tmp_path, capsys,
                                                                                monkeypatch):
    train = ["train", "lm", *TINY_LM, *LM_CLI_QUIET, f"data.path={src}", f"data.max_bytes={MAX_BYTES}",
             "observe.log_every=1"]
    assert main([*train, "--run-dir", str(tmp_path / "first")]) == 0
    assert "tokenized in" in capsys.readouterr().out
    (entry,) = _entries(cache)
    # The cached tokens are the in-memory path's, bit for bit.
    dataset = prepared.PreparedDataset.open(cache / "data" / entry)
    for split, docs in zip(("train", "validation"), split_documents(read_documents(str(src), max_bytes=MAX_BYTES), VAL),
                           strict=True):
        np.testing.assert_array_equal(_all(dataset, split), encode_documents(docs, ByteTokenizer()))
        assert dataset.index["splits"][split]["bytes"] == sum(len(d.text.encode()) for d in docs)

    def refuse(*_):
        raise AssertionError("a hit must not tokenize")

    monkeypatch.setattr(ByteTokenizer, "encode_batch", refuse)
    monkeypatch.setattr(ByteTokenizer, "encode", refuse)
    assert main([*train, "--run-dir", str(tmp_path / "second")]) == 0
    assert f"read from the cache {cache / 'data' / entry}" in capsys.readouterr().out
    first = _losses(tmp_path / "first")
    assert sorted(first) == list(range(1, 11)) and _losses(tmp_path / "second") == first
    assert _entries(cache) == [entry]


def test_a_changed_byte_is_a_new_key_and_mtimes_are_not_the_key(src, cache):
    first, note = _load(src)
    assert "tokenized in" in note
    assert "read from the cache" in _load(src)[1]
    file = src / "json" / "decoder.py"
    content, stat = file.read_bytes(), file.stat()
    file.write_bytes(content[:100] + bytes([content[100] ^ 1]) + content[101:])
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: only the content differs
    second, note = _load(src)
    assert "tokenized in" in note and len(_entries(cache)) == 2
    assert not np.array_equal(_all(first, "train"), _all(second, "train")) or \
        not np.array_equal(_all(first, "validation"), _all(second, "validation"))
    file.write_bytes(content)
    os.utime(file)  # back to the old content with a new mtime: the old entry again
    assert _load(src)[0].root == first.root


@pytest.mark.parametrize("damage", ["shard", "index", "unigram"])
def test_a_damaged_entry_is_prepared_again(src, cache, damage):
    good, _ = _load(src)
    want = _all(good, "train")
    if damage == "shard":
        shard = good.root / "train-00000.bin"
        content = bytearray(shard.read_bytes())
        content[10] ^= 1
        shard.write_bytes(bytes(content))
        os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # a later write
    elif damage == "index":
        (good.root / "index.json").write_text("{")
    else:
        (good.root / "validation-unigram.npy").unlink()
    again, note = _load(src)
    assert "failed its check" in note and "prepared again" in note and "tokenized in" in note
    assert again.root == good.root and _entries(cache) == [good.root.name]
    np.testing.assert_array_equal(_all(again, "train"), want)
    assert "read from the cache" in _load(src)[1]


def test_two_preparers_of_one_key_end_with_one_entry(src, cache, monkeypatch):
    write, both_written = prepare_mod.write_encoded, threading.Barrier(2, timeout=120)

    def write_then_wait(*args, **kwargs):
        write(*args, **kwargs)
        both_written.wait()  # neither renames before both have written: the second rename finds the first's entry

    monkeypatch.setattr(prepare_mod, "write_encoded", write_then_wait)
    results, errors = [], []

    def run():
        try:
            results.append(_load(src))
        except BaseException as error:  # noqa: BLE001  (reported by the assert below)
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2
    assert all("tokenized in" in note for _, note in results)  # both missed
    (entry,) = _entries(cache)  # one entry, no temporary folders left
    assert {r.root.name for r, _ in results} == {entry}
    prepared.PreparedDataset.open(cache / "data" / entry)  # whole: every shard's SHA-256 matches
    np.testing.assert_array_equal(_all(results[0][0], "train"), _all(results[1][0], "train"))


# VERIFIED SHARDS ----------------------------------------------------------------------------------------------


def test_a_second_start_does_not_hash_and_a_modified_shard_still_fails(src, cache, tmp_path, capsys, monkeypatch):
    out = tmp_path / "prepared"
    prepare(str(src), out, val_percent=VAL, shard_tokens=20_000, workers=1)
    shards = sum(len(prepared.PreparedDataset.open(out, verify=False).shards(s)) for s in prepared.SPLITS)
    hashed = []
    sha256 = prepared.file_sha256
    monkeypatch.setattr(prepared, "file_sha256", lambda path: hashed.append(path) or sha256(path))
    prepared.PreparedDataset.open(out, trust_verified=True)  # a training start: every shard read once ...
    assert len(hashed) == shards > 2
    hashed.clear()
    prepared.PreparedDataset.open(out, trust_verified=True)  # ... and not at the next
    assert hashed == []
    assert main(["data", "info", str(out)]) == 0  # the explicit check reads them all
    assert len(hashed) == shards
    # Rewritten in place (same inode and size, a later mtime): training reads it again and refuses it.
    hashed.clear()
    shard = out / "train-00001.bin"
    content = bytearray(shard.read_bytes())
    content[7] ^= 1
    shard.write_bytes(bytes(content))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    run = tmp_path / "run"
    argv = ["train", "lm", *TINY_LM, *LM_CLI_QUIET, f"data.path={out}", "data.max_bytes=0", "-q", "--run-dir", str(run)]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "shard train-00001.bin fails its SHA-256 check" in err and "Traceback" not in err
    assert hashed == [shard] and not run.exists()
