"""The real entry point on a tiny recipe: train, resume, generate (Levanter-style "pulse" test)."""

import json
import subprocess
import sys
from pathlib import Path

from tiny import TINY_LM

# TensorBoard, plots and sampling on: this test checks them.
TINY = [*TINY_LM, "data.max_bytes=300000", "data.val_percent=30", "train.eval_every=4", "train.eval_batches=2",
        "checkpoint.every_steps=4", "observe.log_every=2", "sample.max_new_tokens=16"]


def systolic(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "systolic", *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return proc


def test_train_resume_generate(tmp_path: Path):
    run = tmp_path / "run"
    first = systolic("train", "lm", *TINY, "train.steps=4", "--run-dir", str(run))
    assert "validation:" in first.stdout and "unigram baseline" in first.stdout
    assert (run / "config.yaml").is_file() and (run / "loss.png").is_file()
    assert list((run / "tensorboard").iterdir())

    second = systolic("train", "lm", *TINY, "train.steps=8", "--run-dir", str(run))
    assert "resumed from checkpoint step 4" in second.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r["split"] == "train"]
    assert train_steps == list(range(1, 9)), "resume continues the step count without repeats or gaps"
    assert {r["step"] for r in records if r["split"] == "eval"} == {4, 8}
    assert all({"step", "split", "loss"} <= r.keys() for r in records)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8]

    # 11 prompt tokens + 16 new ones fit the tiny model's 32 positions.
    out = systolic("generate", str(run), "--prompt", "def fib(n):", "--max-new-tokens", "16", "--temperature", "0")
    assert out.stdout.startswith("def fib(n):") and len(out.stdout) > len("def fib(n):")
    again = systolic("generate", str(run), "--prompt", "def fib(n):", "--max-new-tokens", "16", "--temperature", "0")
    assert again.stdout == out.stdout, "greedy decoding is deterministic"
