"""The run directory's guarantees (engine/rundir.py with its `transaction`, runtime/interrupts.py): only
systolic's own folders are written, one writer at a time, and a failed command leaves no trace."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import LM_CLI_QUIET, TINY_LM

from systolic.cli import main
from systolic.engine import rundir

TINY = [*TINY_LM, *LM_CLI_QUIET, "train.eval_every=1000", "observe.log_every=1", "checkpoint.every_steps=3",
        "train.steps=6", "--quiet"]


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file under root (relative path -> SHA-256), and every folder (-> 'dir')."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def train(run_dir: Path, *extra: str) -> int:
    return main(["train", "lm", *TINY, *extra, "--run-dir", str(run_dir)])


def test_a_users_own_folder_is_refused_and_left_byte_identical(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("learning_rate: 0.1  # my own notes\n")
    (mine / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.9}\n')
    (mine / "notes.txt").write_text("do not lose me\n")
    before = tree_hashes(mine)
    assert train(mine) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "did not create" in err and "nothing in it was touched" in err and "Traceback" not in err
    assert tree_hashes(mine) == before


def test_a_run_directory_inside_another_run_is_refused_and_the_outer_run_left_byte_identical(tmp_path, capsys):
    """`--run-dir RUN/checkpoints/new` would put a folder among RUN's steps (issue 45: writing inside a run)."""
    outer = tmp_path / "outer"
    (outer / "checkpoints" / "3").mkdir(parents=True)
    (outer / rundir.MARKER_FILE).write_text('{"workload": "lm"}\n')
    (outer / "checkpoints" / "3" / "state").write_text("a step's bytes\n")
    before = tree_hashes(outer)
    for inner in (outer / "checkpoints" / "new", outer / "nested" / "run"):
        assert train(inner) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"--run-dir {inner} is inside the run directory {outer}" in err and "Fix:" in err, err
        assert tree_hashes(outer) == before and not inner.exists()


def test_an_empty_folder_becomes_a_run_and_a_run_directory_is_reused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train(empty, "train.steps=3") == 0
    marker = json.loads((empty / rundir.MARKER_FILE).read_text())
    assert marker["workload"] == "lm"
    assert train(empty, "train.steps=6") == 0  # resumes in its own directory
    rows = [json.loads(line) for line in (empty / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["split"] == "train"]
    assert steps == sorted(set(steps)) and max(steps) == 6


def test_a_run_written_before_markers_existed_is_still_accepted(tmp_path):
    run = tmp_path / "old"
    assert train(run, "train.steps=3") == 0
    (run / rundir.MARKER_FILE).unlink()  # as a run from an older systolic looks
    assert train(run, "train.steps=6") == 0
    assert (run / rundir.MARKER_FILE).is_file()


def test_a_second_writer_is_refused_with_the_holders_pid_and_changes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, "train.steps=3") == 0
    before = tree_hashes(run)
    holder = rundir.RunLock(run)
    holder.acquire()  # as another systolic process holds it
    try:
        assert train(run, "train.steps=6") == 2
    finally:
        holder.release()
    err = " ".join(capsys.readouterr().err.split())
    assert f"process {os.getpid()} holds" in err and "another --run-dir" in err
    assert tree_hashes(run) == before


def test_a_killed_holders_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    # A process that takes the lock and is killed while holding it (the kernel drops its flock).
    code = f"from systolic.engine import rundir; from pathlib import Path; import os, signal, time; " \
           f"p = Path({str(run)!r}); p.mkdir(); l = rundir.RunLock(p); l.acquire(); os.kill(os.getpid(), signal.SIGKILL)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert (run / rundir.LOCK_FILE).read_text().strip().isdigit()  # its PID is still written there
    assert train(run, "train.steps=3") == 0


def test_an_unexpected_error_rolls_back_a_new_nested_directory_and_an_existing_run(tmp_path, monkeypatch):
    from systolic.engine import run as run_driver

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    nested = tmp_path / "nest" / "a" / "b"
    (tmp_path / "nest").mkdir()
    monkeypatch.setattr(run_driver, "train", broken)
    with pytest.raises(RuntimeError):
        train(nested)
    assert list((tmp_path / "nest").iterdir()) == []  # nest/a went too; nest was there before
    monkeypatch.undo()

    run = tmp_path / "run"
    assert train(run, "train.steps=3") == 0
    (run / "config.yaml").unlink()  # a user deleted it
    before = tree_hashes(run)
    monkeypatch.setattr(run_driver, "train", broken)
    with pytest.raises(RuntimeError):
        train(run, "train.steps=6", "train.seed=7")
    assert tree_hashes(run) == before  # no config.yaml written, nothing else changed


def test_interrupted_start_of_an_existing_run_restores_its_config_and_metrics(tmp_path, monkeypatch):
    from systolic.engine import run as run_driver
    from systolic.runtime.interrupts import Interrupted

    run = tmp_path / "run"
    assert train(run, "train.steps=3") == 0
    before = tree_hashes(run)

    def interrupted(*args, **kwargs):
        raise Interrupted("SIGTERM")

    monkeypatch.setattr(run_driver, "train", interrupted)
    assert train(run, "train.steps=6", "train.eval_every=2") == 143
    assert tree_hashes(run) == before


def test_a_fresh_start_drops_the_rows_of_a_run_that_never_checkpointed(tmp_path):
    run = tmp_path / "run"
    assert train(run, "train.steps=2", "checkpoint.every_steps=100") == 0
    import shutil

    shutil.rmtree(run / "checkpoints")  # as if killed before its first checkpoint
    assert train(run, "train.steps=2", "checkpoint.every_steps=100") == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "train"]
    assert steps == [0, 1, 2] or steps == [1, 2]  # once each, not twice


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "systolic", "train", "lm", *TINY, *extra, "--run-dir", str(run_dir)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_trains_started_together_one_runs_and_its_checkpoints_resume_bit_exactly(tmp_path):
    run = tmp_path / "run"
    first, second = _start(run), _start(run)
    results = [(p.returncode, err) for p in (first, second) for _, err in [p.communicate(timeout=600)]]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "in use by another systolic command" in " ".join(loser.split()) and "Traceback" not in loser
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if r["split"] == "train" and r["step"] > 0}
    assert sorted(losses) == list(range(1, 7))  # one run's rows, each step once
    # Every checkpoint restores (checksums verified), and resuming from step 3 gives the same steps 4-6.
    from systolic.config import CheckpointConfig
    from systolic.engine.checkpoint import Checkpointer

    ckpt = Checkpointer(run / "checkpoints", CheckpointConfig())
    assert ckpt.all_steps() == [3, 6] and [ckpt.verify(s) for s in (3, 6)] == [None, None]
    ckpt.close()
    import shutil

    shutil.rmtree(run / "checkpoints" / "6")
    assert train(run) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    again = {r["step"]: r["loss"] for r in records if r["split"] == "train" and r["step"] > 0}
    assert again == losses


@pytest.mark.slow
def test_sigint_at_twenty_moments_of_start_up_always_exits_cleanly_and_resumes(tmp_path):
    """Ctrl-C at 20 moments spread over a run's first seconds (start-up, tracing, compiling, stepping, saving):
    never a crash (139), never a completed run, always exit 130 (or 0 for a stop that checkpointed) with a run
    directory that resumes, or none at all. A signal in the interpreter's own start-up, before systolic's first
    line, ends the process by SIGINT as any Python program (nothing created yet)."""
    # The moments cover start-up to a few steps in, however loaded the machine: first measure when steps begin.
    t0, reference = time.monotonic(), _start(tmp_path / "reference", "train.steps=200")
    while not (tmp_path / "reference" / "metrics.jsonl").exists() and reference.poll() is None:
        time.sleep(0.05)
    first_step_s = time.monotonic() - t0
    reference.send_signal(signal.SIGINT)
    reference.communicate(timeout=300)
    span = max(10.0, first_step_s + 3.0)
    outcomes = []
    for i in range(20):
        run = tmp_path / f"run{i}"
        proc = _start(run, "train.steps=200")
        time.sleep(span * i / 19)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode in (0, 130, -signal.SIGINT), (i, proc.returncode, err)
        if proc.returncode == -signal.SIGINT:  # Python's own exit, before systolic's handler was installed
            assert not run.exists(), (i, err)
        assert "Traceback" not in err, (i, err)
        if proc.returncode == 0:
            # Stopped early (--quiet: no message), with a checkpoint at the step it stopped on.
            steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
            assert steps and steps[-1] < 200, (i, steps)
        if run.exists():  # resumes (or starts afresh) and runs on
            ckpts = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()] \
                if (run / "checkpoints").is_dir() else []
            stop = max(ckpts, default=0) + 2
            assert train(run, "train.steps=200", f"loop.stop_at_step={stop}") == 0, i
        outcomes.append((round(span * i / 19, 1), proc.returncode, run.exists()))
    print(f"\nfirst step after {first_step_s:.1f} s; SIGINT after s -> exit code, run directory kept:", outcomes)
    assert any(code == 0 for _, code, _ in outcomes), "no moment reached the train loop"


def test_resuming_from_a_step_without_its_manifest_says_it_is_unverified(tmp_path):
    from systolic.engine.checkpoint import MANIFEST

    run = tmp_path / "run"
    assert train(run, "train.steps=3") == 0
    (run / "checkpoints" / "3" / MANIFEST).unlink()
    with pytest.warns(UserWarning, match="could not be checked for damage"):
        assert train(run, "train.steps=6") == 0


def test_orbaxs_own_report_of_a_failed_save_is_left_to_our_one_paragraph(monkeypatch):
    """Disk full while saving (measured on a 700 kB tmpfs): Orbax logged two raw tracebacks through absl before our
    CheckpointWriteError paragraph; the filter drops them unless SYSTOLIC_DEBUG is set."""
    import logging

    from systolic.engine.checkpoint import _ORBAX_FILTER

    def record(path: str, level: int) -> logging.LogRecord:
        return logging.LogRecord("absl", level, path, 1, "Save Finalize thread failed", None, None)

    orbax = "/venv/site-packages/orbax/checkpoint/_src/checkpointers/async_checkpointer.py"
    monkeypatch.delenv("SYSTOLIC_DEBUG", raising=False)
    assert not _ORBAX_FILTER.filter(record(orbax, logging.ERROR))
    assert _ORBAX_FILTER.filter(record(orbax, logging.WARNING))
    assert _ORBAX_FILTER.filter(record("/venv/site-packages/jax/_src/x.py", logging.ERROR))
    monkeypatch.setenv("SYSTOLIC_DEBUG", "1")
    assert _ORBAX_FILTER.filter(record(orbax, logging.ERROR))


def test_a_run_saved_before_new_model_keys_existed_still_matches_its_settings(tmp_path):
    """Upgrading systolic adds config keys with defaults; a run saved without them is the same model."""
    import yaml

    run = tmp_path / "run"
    assert train(run, "train.steps=3") == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    del saved["model"]["parametrization"], saved["model"]["mup_base_width"]  # as an older version wrote it
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert train(run, "train.steps=6") == 0
