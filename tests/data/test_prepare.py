"""`systolic data prepare`: prepared tokens equal today's in-memory encoding of the same split; an interrupted
preparation resumes to the same bytes; training reads a prepared folder and resumes to the same losses; bad data
is one paragraph, exit 2, nothing written."""

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiny import LM_CLI_QUIET, TINY_LM

from systolic.cli import main
from systolic.data import prepare as prepare_mod
from systolic.data.bpe import train_bpe
from systolic.data.corpus import read_documents, split_documents, stdlib_dir
from systolic.data.prepare import prepare
from systolic.data.prepared import PreparedDataset
from systolic.data.text import encode_documents
from systolic.data.tokenizer import make_tokenizer
from systolic.errors import UserError

VAL = 30.0
_TINY = dict(arg.split("=", 1) for arg in TINY_LM)
TINY_BATCH, TINY_SEQ = int(_TINY["train.batch_size"]), int(_TINY["data.seq_len"])
pytestmark = pytest.mark.filterwarnings("ignore:Skipped 1")  # blob.bin, on purpose


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """~200 kB of the standard library's json and email packages, plus an empty, a binary and a nested file."""
    root = tmp_path_factory.mktemp("corpus")
    for package in ("json", "email"):
        for file in sorted((stdlib_dir() / package).glob("*.py")):
            (root / package).mkdir(exist_ok=True)
            (root / package / file.name).write_bytes(file.read_bytes())
    (root / "empty.txt").write_text("")
    (root / "blob.bin").write_bytes(b"\x00\x01binary")
    (root / "deep" / "er").mkdir(parents=True)
    (root / "deep" / "er" / "note.txt").write_text("héllo wörld 🚀\n" * 50)
    return root


@pytest.fixture(scope="module")
def bpe_file(corpus_dir, tmp_path_factory) -> Path:
    texts = [d.text for d in read_documents(str(corpus_dir))]
    path = tmp_path_factory.mktemp("tok") / "tok.json"
    train_bpe(texts, 300, length=len(texts)).save(path)
    return path


def _all_tokens(dataset: PreparedDataset, split: str) -> np.ndarray:
    tokens = dataset.tokens(split)
    return tokens[np.arange(len(tokens))]


def _expected(src: Path, spec: str):
    tok = make_tokenizer(spec)
    train, val = split_documents(read_documents(str(src)), VAL)
    return tok, {"train": (train, encode_documents(train, tok)), "validation": (val, encode_documents(val, tok))}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("tokenizer, workers", [("byte", 1), ("bpe", 2)])
def test_prepared_tokens_equal_encode_documents(corpus_dir, bpe_file, tmp_path, tokenizer, workers):
    spec = str(bpe_file) if tokenizer == "bpe" else "byte"
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="Skipped 1"):  # blob.bin
        prepare(str(corpus_dir), out, tokenizer=spec, val_percent=VAL, shard_tokens=7_000, workers=workers)
    dataset = PreparedDataset.open(out)
    tok, expected = _expected(corpus_dir, spec)
    assert dataset.dtype == np.dtype(tok.dtype) and not (out.parent / "out.partial").exists()
    for split, (docs, tokens) in expected.items():
        np.testing.assert_array_equal(_all_tokens(dataset, split), tokens)
        offsets = np.load(out / f"{split}-docs.npy")
        assert len(offsets) == len(docs) + 1 and offsets[-1] == len(tokens)
        assert all(tokens[end - 1] == tok.eot_id for end in offsets[1:])
        np.testing.assert_array_equal(dataset.unigram(split), np.bincount(tokens, minlength=tok.vocab_size))
        info = dataset.index["splits"][split]
        assert info["bytes"] == sum(len(d.text.encode()) for d in docs)
        assert [s["tokens"] for s in info["shards"]][:-1] == [7_000] * (len(info["shards"]) - 1)
    if tokenizer == "bpe":
        assert (out / "tokenizer.json").read_bytes() == bpe_file.read_bytes()


def test_jsonl_gz_and_arrow_records_with_a_field(tmp_path):
    pa = pytest.importorskip("pyarrow")
    rows = [{"content": f"document {i} " * (i + 1)} for i in range(40)]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    hf = tmp_path / "hf"
    hf.mkdir()
    with pa.OSFile(str(hf / "data-00000-of-00001.arrow"), "wb") as sink:  # what `datasets.save_to_disk` writes
        table = pa.table({"content": [r["content"] for r in rows]})
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (hf / "state.json").write_text("{}")
    (hf / "dataset_info.json").write_text("{}")
    for src, name, shard_tokens in ((tmp_path / "a.jsonl.gz", "gz", 500), (hf, "arrow", 1 << 26)):  # 1 shard each
        prepare(str(src), tmp_path / name, field="content", val_percent=VAL, shard_tokens=shard_tokens, workers=1)
        dataset = PreparedDataset.open(tmp_path / name)
        assert sum(dataset.index["splits"][s]["documents"] for s in ("train", "validation")) == 40
        assert sum(len(dataset.tokens(s)) for s in ("train", "validation")) == sum(len(r["content"]) + 1 for r in rows)


def test_interrupted_prepare_resumes_to_the_same_bytes(corpus_dir, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    with pytest.warns(UserWarning):
        prepare(str(corpus_dir), whole, val_percent=VAL, shard_tokens=5_000, workers=1)
    write_shard, calls = prepare_mod._write_shard, []

    def stop_after_three(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt  # a kill between shards 3 and 4
        calls.append(1)
        write_shard(*args)

    out = tmp_path / "resumed"
    monkeypatch.setattr(prepare_mod, "_write_shard", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(corpus_dir), out, val_percent=VAL, shard_tokens=5_000, workers=1)
    assert not out.exists() and (tmp_path / "resumed.partial" / "progress.json").is_file()
    monkeypatch.setattr(prepare_mod, "_write_shard", write_shard)
    saved = _files(tmp_path / "resumed.partial")
    with pytest.raises(UserError, match="other settings"):  # a different command does not mix into it ...
        prepare(str(corpus_dir), out, val_percent=VAL, shard_tokens=6_000, workers=1)
    assert _files(tmp_path / "resumed.partial") == saved  # ... nor removes its progress
    monkeypatch.setattr(prepare_mod, "_write_shard", stop_after_three)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):  # interrupted twice: after shards 3 and 6
        prepare(str(corpus_dir), out, val_percent=VAL, shard_tokens=5_000, workers=1)
    monkeypatch.setattr(prepare_mod, "_write_shard", write_shard)
    with pytest.warns(UserWarning):
        prepare(str(corpus_dir), out, val_percent=VAL, shard_tokens=5_000, workers=1)
    assert not (tmp_path / "resumed.partial").exists()
    assert _files(out) == _files(whole)


def test_a_kill_at_any_shard_resumes_to_the_same_bytes(corpus_dir, tmp_path, monkeypatch):
    """Shards are written as tokens come: a kill may leave the open shard longer than the saved progress, or
    closed after it; the resumed run cuts it back and writes the uninterrupted bytes."""
    whole = tmp_path / "whole"
    with pytest.warns(UserWarning):
        prepare(str(corpus_dir), whole, val_percent=VAL, shard_tokens=7_000, workers=1)
    write_shard = prepare_mod._write_shard
    monkeypatch.setattr(prepare_mod, "_FLUSH_TOKENS", 1_000)  # open shards grow between saves, too
    for stop in range(1, 8):
        calls = []

        def stop_at(*args, stop=stop, calls=calls):
            if len(calls) == stop:
                raise KeyboardInterrupt
            calls.append(1)
            write_shard(*args)

        out = tmp_path / f"stop{stop}"
        monkeypatch.setattr(prepare_mod, "_write_shard", stop_at)
        with pytest.raises(KeyboardInterrupt):
            prepare(str(corpus_dir), out, val_percent=VAL, shard_tokens=7_000, workers=1)
        monkeypatch.setattr(prepare_mod, "_write_shard", write_shard)
        with pytest.warns(UserWarning):
            prepare(str(corpus_dir), out, val_percent=VAL, shard_tokens=7_000, workers=1)
        assert _files(out) == _files(whole), stop


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


@pytest.fixture(scope="module")
def prepared_dir(corpus_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    assert main(["data", "prepare", str(corpus_dir), "--out", str(out), "--val-percent", "30",
                 "--shard-tokens", "20000", "--workers", "1"]) == 0
    return out


TRAIN = ["train", "lm", *TINY_LM, *LM_CLI_QUIET, "data.max_bytes=0", "observe.log_every=1", "-q"]


def test_train_on_prepared_data_resumes_to_the_same_losses(prepared_dir, tmp_path, capsys):
    data = f"data.path={prepared_dir}"
    assert main([*TRAIN, data, "--run-dir", str(tmp_path / "whole")]) == 0
    assert main([*TRAIN, data, "loop.stop_at_step=4", "--run-dir", str(tmp_path / "resumed")]) == 0
    assert main([*TRAIN, data, "--run-dir", str(tmp_path / "resumed")]) == 0
    whole, resumed = _losses(tmp_path / "whole"), _losses(tmp_path / "resumed")
    assert sorted(whole) == list(range(1, 11)) and resumed == whole
    assert main(["data", "info", str(prepared_dir)]) == 0
    assert "match their SHA-256" in capsys.readouterr().out


def test_a_bpe_prepared_dataset_brings_its_tokenizer(corpus_dir, bpe_file, tmp_path):
    """No data.tokenizer: the run takes the one the data was prepared with (a copy in its folder), not the byte one."""
    data = tmp_path / "bpe-data"
    assert main(["data", "prepare", str(corpus_dir), "--out", str(data), "--tokenizer", str(bpe_file),
                 "--val-percent", "30", "--workers", "1"]) == 0
    run = tmp_path / "run"
    assert main([*TRAIN, f"data.path={data}", "train.steps=2", "--run-dir", str(run)]) == 0
    assert f"tokenizer: {data / 'tokenizer.json'}" in (run / "config.yaml").read_text()
    assert (run / "tokenizer.json").read_bytes() == bpe_file.read_bytes()


def _fails_cleanly(argv: list[str], capsys, message: str, untouched: Path) -> None:
    before = _files(untouched) if untouched.exists() else None
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err
    assert (_files(untouched) if untouched.exists() else None) == before


def test_bad_data_exits_2_and_writes_nothing(prepared_dir, bpe_file, tmp_path, capsys):
    run = tmp_path / "run"
    train = [*TRAIN, "--run-dir", str(run)]
    # A tokenizer other than the one the data was prepared with.
    _fails_cleanly([*train, f"data.path={prepared_dir}", f"data.tokenizer={bpe_file}"], capsys, "a different tokenizer", run)
    # A split other than the prepared one.
    _fails_cleanly([*train, f"data.path={prepared_dir}", "data.val_percent=5"], capsys, "data.val_percent=30", run)
    # A shard whose bytes changed, and a truncated one: for training and for `data info`.
    for damage, message in (("flip", "fails its SHA-256 check"), ("truncate", "has 39,998 bytes where")):
        bad = tmp_path / damage
        bad.mkdir()
        for name, content in _files(prepared_dir).items():
            (bad / name).write_bytes(content)
        shard = bad / "train-00000.bin"
        content = shard.read_bytes()
        shard.write_bytes(content[:1] + bytes([content[1] ^ 1]) + content[2:] if damage == "flip" else content[:-2])
        _fails_cleanly([*train, f"data.path={bad}"], capsys, message, run)
        _fails_cleanly(["data", "info", str(bad)], capsys, message, bad)
    assert not run.exists()
    # An empty corpus: nothing is written, not even the partial folder.
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    _fails_cleanly(["data", "prepare", str(empty), "--out", str(tmp_path / "out"), "--workers", "1"], capsys,
                   "split would be empty", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    # An existing output folder is never overwritten.
    _fails_cleanly(["data", "prepare", str(empty), "--out", str(prepared_dir)], capsys, "already exists", prepared_dir)


def test_resume_refuses_an_input_that_changed(corpus_dir, tmp_path, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(corpus_dir, src)
    write_shard, calls = prepare_mod._write_shard, []

    def stop_after_two(*args):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        write_shard(*args)

    monkeypatch.setattr(prepare_mod, "_write_shard", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(src), tmp_path / "out", val_percent=VAL, shard_tokens=5_000, workers=1)
    monkeypatch.setattr(prepare_mod, "_write_shard", write_shard)
    (src / "aaa.txt").write_text("a file that sorts first shifts every later record")
    with pytest.raises(UserError, match="changed since the interrupted preparation"):
        prepare(str(src), tmp_path / "out", val_percent=VAL, shard_tokens=5_000, workers=1)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_memory_mapped_batches_equal_in_memory_ones_and_split_over_processes(prepared_dir):
    from systolic.data.text import make_train_iterator

    tokens = PreparedDataset.open(prepared_dir).tokens("train")  # 20,000-token shards: windows straddle them
    in_memory = tokens[np.arange(len(tokens))]
    kwargs = dict(seq_len=16, global_batch=8, seed=3)
    mapped, array = make_train_iterator(tokens, **kwargs), make_train_iterator(in_memory, **kwargs)
    halves = [make_train_iterator(tokens, **kwargs, process_index=i, process_count=2) for i in range(2)]
    for _ in range(30):
        batch, want = next(mapped), next(array)
        np.testing.assert_array_equal(batch["inputs"], want["inputs"])
        np.testing.assert_array_equal(batch["targets"], want["targets"])
        parts = [next(h) for h in halves]  # each process reads its own 4 rows; together the global batch
        np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]), want["inputs"])


@pytest.fixture(scope="module")
def two_prepared(corpus_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mixture")
    for package in ("json", "email"):
        assert main(["data", "prepare", str(corpus_dir / package), "--out", str(root / package), "--val-percent",
                     "30", "--shard-tokens", "20000", "--workers", "1"]) == 0
    return root / "json", root / "email"


def test_mixture_rows_follow_the_weights(two_prepared):
    from systolic.data.text import make_mixture_iterator

    a, b = (PreparedDataset.open(p).tokens("train") for p in two_prepared)
    first_a = {bytes(a[np.arange(i * 16, i * 16 + 17)].astype(np.int32)) for i in range((len(a) - 1) // 16)}
    it = make_mixture_iterator([a, b], [3.0, 1.0], seq_len=16, global_batch=8, seed=0)
    rows = np.concatenate([np.concatenate([x["inputs"], x["targets"][:, -1:]], axis=1) for x in (next(it) for _ in range(50))])
    from_a = np.mean([bytes(r) in first_a for r in rows.astype(np.int32)])
    assert from_a == pytest.approx(0.75, abs=0.01)


@pytest.mark.parametrize("weights", [(0.7, 0.3), (3, 1), (1, 1, 1), (0.123, 5.0, 2.5)])
def test_mixture_counts_equal_grains_own_interleaving(weights):
    import grain

    from systolic.data.text import mixture_counts

    tags = [grain.MapDataset.range(1).repeat(None).map(lambda _, i=i: i) for i in range(len(weights))]
    mixed = grain.MapDataset.mix(tags, list(weights))
    sources = np.array([mixed[k] for k in range(3000)])
    for rows in (0, 1, 7, 64, 999, 3000):
        assert mixture_counts(rows, weights) == [int((sources[:rows] == i).sum()) for i in range(len(weights))]


def _source_tokens(run: Path) -> dict[int, tuple[float, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["tokens/json"], r["tokens/email"]) for r in records if r["split"] == "train"}


def test_train_on_a_mixture_killed_then_resumed_gives_the_same_losses(two_prepared, tmp_path, capsys):
    mixture = f"data.mixture={two_prepared[0]}:0.7,{two_prepared[1]}:0.3"
    assert main([*TRAIN, mixture, "--run-dir", str(tmp_path / "whole")]) == 0
    # Killed (SIGKILL) while writing the step-6 checkpoint: the rerun resumes from step 3's, data position included.
    killed = subprocess.run([sys.executable, "-m", "systolic", *TRAIN, mixture, "checkpoint.every_steps=3",
                             "--run-dir", str(tmp_path / "resumed")], env=dict(os.environ, SYSTOLIC_FAULT=
                            "kill_during_save:6"), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]
    assert main([*TRAIN, mixture, "checkpoint.every_steps=3", "--run-dir", str(tmp_path / "resumed")]) == 0
    whole = _losses(tmp_path / "whole")
    assert sorted(whole) == list(range(1, 11)) and _losses(tmp_path / "resumed") == whole
    # Tokens per source so far: every step's tokens counted once, split 7:3, the same after the resume.
    counts = _source_tokens(tmp_path / "whole")
    assert counts == _source_tokens(tmp_path / "resumed")
    per_step = TINY_BATCH * TINY_SEQ
    assert [sum(counts[s]) for s in range(1, 11)] == [s * per_step for s in range(1, 11)]
    assert counts[10][0] / (10 * per_step) == pytest.approx(0.7, abs=1 / TINY_BATCH)
    run = tmp_path / "bad"
    for bad, message in ((f"data.mixture={two_prepared[0]}:0", "positive weight"),
                         (f"data.mixture={two_prepared[0]}:x", "positive weight"),
                         (f"data.mixture={tmp_path}:1", "not a prepared dataset")):
        _fails_cleanly([*TRAIN, bad, "--run-dir", str(run)], capsys, message, run)
    _fails_cleanly([*TRAIN, mixture, f"data.path={two_prepared[0]}", "--run-dir", str(run)], capsys, "both set", run)
    assert not run.exists()
