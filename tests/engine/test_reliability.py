"""Crashes, preemption, corruption, failed writes and NaNs, through the real CLI in subprocesses."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import LM_CLI_QUIET, TINY_LM

TINY = [*TINY_LM, *LM_CLI_QUIET, "train.eval_every=1000", "observe.log_every=1", "checkpoint.every_steps=3"]


def start(run: Path, *extra: str, fault: str | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    if fault:
        env["SYSTOLIC_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "systolic", "train", "lm", *TINY, *extra, "--run-dir", str(run)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(run_dir: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    proc = start(run_dir, *extra, fault=fault)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    pytest.fail(f"step {step} not reached")


def steps_on_disk(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def test_sigkill_anywhere_then_resume_is_bitwise_identical(tmp_path):
    reference = tmp_path / "reference"
    assert run(reference, "train.steps=12").returncode == 0
    expected = losses(reference)
    assert sorted(expected) == list(range(1, 13))

    # 1. Killed in the middle of writing the step-6 checkpoint: resumes from step 3.
    crashed = tmp_path / "during-save"
    assert run(crashed, "train.steps=12", fault="kill_during_save:6").returncode == -signal.SIGKILL
    second = run(crashed, "train.steps=12")
    assert second.returncode == 0, second.stderr
    assert "resumed from checkpoint step 3" in second.stderr
    assert losses(crashed) == expected  # bit for bit: float equality of every step's loss

    # 2. Killed between checkpoints, at a moment chosen by the clock, then twice more.
    killed = tmp_path / "anywhere"
    for at in (4, 8):
        proc = start(killed, "train.steps=12")
        wait_for_step(killed, at, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    final = run(killed, "train.steps=12")
    assert final.returncode == 0, final.stderr
    assert losses(killed) == expected


def test_sigterm_checkpoints_the_current_step_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "train.steps=100000", "checkpoint.every_steps=100000")
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Run the same command again to continue" in err
    last = max(losses(run_dir))
    assert steps_on_disk(run_dir) == [last]  # the checkpoint is at the interrupted step


def test_corrupted_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    run_dir = tmp_path / "run"
    assert run(run_dir, "train.steps=6").returncode == 0
    assert steps_on_disk(run_dir) == [3, 6]
    # Flip bytes without changing the size: Orbax alone would restore wrong values silently.
    victim = max((p for p in (run_dir / "checkpoints" / "6" / "params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    resumed = run(run_dir, "train.steps=8")
    assert resumed.returncode == 0, resumed.stderr
    assert "step 6" in resumed.stderr and "damaged" in resumed.stderr
    assert "resumed from checkpoint step 3" in resumed.stderr


def test_failed_checkpoint_write_stops_and_keeps_the_previous_one(tmp_path):
    run_dir = tmp_path / "run"
    failed = run(run_dir, "train.steps=9", fault="fail_save:6")
    assert failed.returncode == 4 and "Traceback" not in failed.stderr
    err = " ".join(failed.stderr.split())  # the message is wrapped at 110 columns
    assert "No space left on device" in err and "previous checkpoint (step 3) is intact" in err
    assert steps_on_disk(run_dir) == [3]
    again = run(run_dir, "train.steps=9")
    assert again.returncode == 0 and "resumed from checkpoint step 3" in again.stderr


def test_nan_halt_names_the_step_and_the_leaf(tmp_path):
    halted = run(tmp_path / "halt", "train.steps=8", "loop.poison_step=5")
    assert halted.returncode == 3 and "Traceback" not in halted.stderr
    message = halted.stderr.replace("\n", " ")
    assert "Step 5 produced a non-finite value in loss" in message
    assert max(losses(tmp_path / "halt")) < 8


def test_nan_skip_discards_the_update_and_goes_on(tmp_path):
    skipped = run(tmp_path / "skip", "train.steps=8", "loop.poison_step=5", "loop.nonfinite=skip")
    assert skipped.returncode == 0, skipped.stderr
    records = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records if r["split"] == "train"}
    assert by_step[5]["loss"] == "nan" and by_step[5]["skipped_total"] == 1
    assert all(isinstance(by_step[s]["loss"], float) for s in (6, 7, 8))
    too_many = run(tmp_path / "strict", "train.steps=8", "loop.poison_step=5", "loop.nonfinite=skip",
                   "loop.max_skipped=0")
    assert too_many.returncode == 3 and "loop.max_skipped=0" in too_many.stderr.replace("\n", " ")
