"""The data cache: prepared shards that passed their SHA-256 check are not read again at the next training start,
while a changed one is still caught."""

import os
from pathlib import Path

import pytest

from tiny import LM_CLI_QUIET, TINY_LM

from systolic.cli import main
from systolic.data import prepared
from systolic.data.corpus import stdlib_dir
from systolic.data.prepare import prepare

VAL = 30.0


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
