"""End to end: each kind of damaged foreign file that tests/test_file_fuzz.py feeds to its reader in-process, here
given to the real CLI in a fresh process (`python -m systolic ...`): exit 2, one paragraph, no traceback, and the
damaged file, every other input and the run directory byte for byte as they were.

A prepared dataset's index.json without `splits` and a pickled unigram table (`train lm data.path=...`), a gan
run's cached classifier truncated, of the wrong shape or pickled (resuming the run), and a checkpoint step whose
manifest is gone and whose arrays no longer load or hold NaN (`generate`, `convert to-hf`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.cli import main
from systolic.config import CheckpointConfig
from systolic.data import prepare, prepared
from systolic.engine import checkpoint, rundir
from systolic.engine.state import TrainState
from systolic.workloads.gan import evaluate as gan_evaluate
from systolic.workloads.lm.hf import convert as hf
from tiny import LM_CLI_QUIET, TINY_GAN, TINY_LM
from tiny_files import TINY_MODEL, VOCAB, write_hf_folder

SRC = Path(__file__).parents[1] / "src"


def snapshot(*roots: Path) -> dict[str, str]:
    """Every file under `roots` (or the file itself) by its SHA-256, folders by name. A run's `.lock` by name only:
    it holds the PID of the last command that took the lock (engine/rundir.py), here a new process's."""
    found = {}
    for root in roots:
        for p in [root] if root.is_file() else sorted(root.rglob("*")):
            plain = p.is_file() and p.name != rundir.LOCK_FILE
            found[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if plain else "present"
    return found


def refused(argv: list[str], *inputs: Path) -> str:
    """Runs the CLI on `argv` in a fresh process; asserts exit 2 with one paragraph and no traceback, and every
    path in `inputs` unchanged. Returns the paragraph, its whitespace collapsed."""
    before = snapshot(*inputs)
    done = subprocess.run([sys.executable, "-m", "systolic", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(SRC)})
    err = done.stderr
    assert done.returncode == 2, f"exit {done.returncode}:\n{err}"
    assert "Traceback" not in err and err.startswith("error: ") and "\n\n" not in err.strip(), err
    assert snapshot(*inputs) == before
    return " ".join(err.split())


# PREPARED DATASETS --------------------------------------------------------------------------------------------


@pytest.fixture
def prepared_data(tmp_path) -> Path:
    source = tmp_path / "text"
    source.mkdir()
    for i in range(12):
        (source / f"doc{i}.txt").write_text(f"document {i}: def f(x):\n    return x * {i}\n" * 40)
    prepare.prepare(str(source), tmp_path / "prepared", val_percent=20.0)
    return tmp_path / "prepared"


def train_on(data: Path, run: Path) -> list[str]:
    quiet = [o for o in LM_CLI_QUIET if not o.startswith(("data.max_bytes", "data.val_percent"))]
    return ["train", "lm", *TINY_LM, *quiet, f"data.path={data}", "data.val_percent=20", "--run-dir", str(run)]


def test_a_prepared_index_without_splits_exits_2(prepared_data, tmp_path):
    index = prepared_data / prepared.INDEX_FILE
    tree = json.loads(index.read_text())
    del tree["splits"]
    index.write_text(json.dumps(tree))
    said = refused(train_on(prepared_data, tmp_path / "run"), prepared_data)
    assert str(index) in said and "splits" in said
    assert not (tmp_path / "run").exists()


def test_a_pickled_unigram_table_exits_2(prepared_data, tmp_path):
    table = next(prepared_data.glob("train*unigram.npy"))
    np.save(table, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    said = refused(train_on(prepared_data, tmp_path / "run"), prepared_data)
    assert table.name in said
    assert not (tmp_path / "run").exists()


# A GAN RUN'S CACHED CLASSIFIER --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gan_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("gan") / "run"
    assert main(["train", "gan", *TINY_GAN, "--run-dir", str(run), "-q"]) == 0
    return run


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _reshaped(_: bytes) -> bytes:
    from io import BytesIO

    out = BytesIO()
    np.savez(out, **{"layer0.w": np.zeros((3, 3), np.float32)})
    return out.getvalue()


def _pickled(_: bytes) -> bytes:
    from io import BytesIO

    out = BytesIO()
    np.savez(out, **{"layer0.w": np.array([{"x": 1}], dtype=object)})
    return out.getvalue()


@pytest.mark.slow  # trains a tiny gan (and its classifier) once, then three fresh CLI processes
@pytest.mark.parametrize("damage", [_truncated, _reshaped, _pickled], ids=["truncated", "wrong shape", "pickled"])
def test_a_damaged_gan_classifier_exits_2_and_the_run_is_unchanged(gan_run, damage):
    classifier = gan_run / gan_evaluate.CLASSIFIER_FILE
    good = classifier.read_bytes()
    try:
        classifier.write_bytes(damage(good))
        said = refused(["train", "gan", *TINY_GAN, "train.steps=6", "--run-dir", str(gan_run), "-q"], gan_run)
        assert str(classifier) in said
    finally:
        classifier.write_bytes(good)


# CHECKPOINTS WITHOUT THEIR MANIFEST ----------------------------------------------------------------------------


@pytest.fixture
def imported(tmp_path) -> Path:
    """A run directory made by `convert from-hf` (a parameters-only step 0), its step's manifest removed."""
    run = tmp_path / "run"
    assert main(["convert", "from-hf", str(write_hf_folder(tmp_path / "hf")), str(run)]) == 0
    (run / "checkpoints" / "0" / checkpoint.MANIFEST).unlink()
    return run


def test_a_manifestless_checkpoint_whose_bytes_do_not_load_exits_2(imported, tmp_path):
    step = imported / "checkpoints" / "0"
    for victim in (p for p in (step / "params").rglob("*") if p.is_file() and p.stat().st_size > 200):
        data = bytearray(victim.read_bytes())
        for i in range(0, len(data), 7):
            data[i] ^= 0xFF
        victim.write_bytes(bytes(data))
    said = refused(["generate", str(imported), "--prompt", "x", "--max-new-tokens", "1"], imported)
    assert "is damaged: it has no manifest" in said
    said = refused(["convert", "to-hf", str(imported), str(tmp_path / "out")], imported)
    assert "is damaged: it has no manifest" in said and not (tmp_path / "out").exists()


def test_a_manifestless_checkpoint_holding_nan_exits_2(imported):
    directory = imported / "checkpoints"
    reader = checkpoint.Checkpointer(directory, CheckpointConfig(async_save=False))
    params = reader.restore_params(0, hf.abstract_params(TINY_MODEL, VOCAB))
    meta = reader.restore_meta(0)
    reader.close()
    shutil.rmtree(directory / "0")
    poisoned = jax.tree.map(lambda a: a.at[(0,) * a.ndim].set(jnp.nan), params)
    writer = checkpoint.Checkpointer(directory, CheckpointConfig(async_save=False))
    writer.save(TrainState(step=jnp.int32(0), params=poisoned, opt_state={}, rng=jax.random.PRNGKey(0)), None, meta)
    writer.wait()
    writer.close()
    (directory / "0" / checkpoint.MANIFEST).unlink()
    said = refused(["generate", str(imported), "--prompt", "x", "--max-new-tokens", "1"], imported)
    assert "holds NaN or Inf" in said
