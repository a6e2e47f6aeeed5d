"""Several local processes joined by jax.distributed (gloo on CPU), driven through `systolic launch`."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tiny import LM_CLI_QUIET, TINY_LM

pytestmark = pytest.mark.multihost

TINY = [*TINY_LM, *LM_CLI_QUIET, "train.eval_every=100", "checkpoint.every_steps=2", "observe.log_every=1",
        "train.steps=6", "-q"]


def systolic(args: list[str], devices: int, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "systolic", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def train_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def test_two_processes_match_one_and_restore_onto_other_meshes(tmp_path):
    # Uninterrupted reference: one process, 4 devices, the same global batch.
    ref = tmp_path / "ref"
    systolic(["train", "lm", *TINY, "mesh.data=2", "mesh.fsdp=2", "--run-dir", str(ref)], devices=4)
    expected = train_losses(ref)

    # Two processes x two devices, stopped after step 4 with a checkpoint.
    multi = tmp_path / "multi"
    systolic(["launch", "--processes", "2", "--devices-per-process", "2", "--", "train", "lm", *TINY,
              "mesh.data=2", "mesh.fsdp=2", "loop.stop_at_step=4", "--run-dir", str(multi)], devices=2)
    got = train_losses(multi)
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [expected[s] for s in range(1, 5)], rtol=1e-5)

    # The checkpoint written by 2 processes x 2 devices resumes on 1 x 1 and on 1 x 8 (fsdp=4: a new layout),
    # optimizer state and data position included: the next losses equal the uninterrupted run's.
    for devices, mesh in ((1, ["mesh.data=1"]), (8, ["mesh.data=2", "mesh.fsdp=4"])):
        run = tmp_path / f"restore{devices}"
        subprocess.run(["cp", "-r", str(multi), str(run)], check=True)
        systolic(["train", "lm", *TINY, *mesh, "--run-dir", str(run)], devices=devices)
        resumed = train_losses(run)
        assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
        np.testing.assert_allclose([resumed[5], resumed[6]], [expected[5], expected[6]], rtol=1e-5)


def test_launch_stops_everything_when_a_process_dies(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    args = [sys.executable, "-m", "systolic", "launch", "--processes", "2", "--devices-per-process", "1", "--",
            "train", "lm", *TINY[:-2], "train.steps=100000", "checkpoint.every_steps=100000", "--run-dir",
            str(tmp_path / "run")]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = {}
    for line in proc.stdout:  # wait until training is under way
        if m := re.match(r"\[launch\] process (\d) started \(pid (\d+)\)", line):
            pids[int(m[1])] = int(m[2])
        if line.startswith("[p0] step 2/"):
            break
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("systolic launch did not exit within 60 s of a process dying")
    assert time.monotonic() - killed_at < 60
    assert proc.returncode != 0
    assert "process 1 was killed by SIGKILL" in out
    for pid in pids.values():  # no process is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_two_processes_read_their_own_rows_of_a_prepared_mixture_and_resume_on_one(tmp_path):
    """Each of two processes reads only its half of each global batch from memory-mapped shards: the losses equal
    one process's reading every row; the checkpoint (data position included) resumes on one process."""
    from systolic.cli import main
    from systolic.data.corpus import stdlib_dir

    for package in ("json", "email"):
        assert main(["data", "prepare", str(stdlib_dir() / package), "--out", str(tmp_path / package),
                     "--val-percent", "30", "--shard-tokens", "20000", "--workers", "1"]) == 0
    run = [*TINY, f"data.mixture={tmp_path / 'json'}:0.7,{tmp_path / 'email'}:0.3", "data.val_percent=30",
           "data.max_bytes=0"]
    ref = tmp_path / "ref"
    systolic(["train", "lm", *run, "mesh.data=2", "--run-dir", str(ref)], devices=2)
    expected = train_losses(ref)
    multi = tmp_path / "multi"
    systolic(["launch", "--processes", "2", "--devices-per-process", "1", "--", "train", "lm", *run, "mesh.data=2",
              "loop.stop_at_step=4", "--run-dir", str(multi)], devices=1)
    got = train_losses(multi)
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [expected[s] for s in range(1, 5)], rtol=1e-5)
    systolic(["train", "lm", *run, "mesh.data=1", "--run-dir", str(multi)], devices=1)
    resumed = train_losses(multi)
    np.testing.assert_allclose([resumed[5], resumed[6]], [expected[5], expected[6]], rtol=1e-5)


def post_training_args(tmp_path: Path, objective: str) -> list[str]:
    """DPO on 40 sum pairs, or GRPO on 40 sum prompts (4 prompts x 4 completions a step), from a 2-step TINY_LM run."""
    base = tmp_path / "base"
    if not base.exists():
        systolic(["train", "lm", *TINY_LM, *LM_CLI_QUIET, "train.steps=2", "-q", "--run-dir", str(base)], devices=1)
    data = tmp_path / f"{objective}.jsonl"
    rng = np.random.default_rng(0)
    if objective == "dpo":
        records = [{"prompt": f"{i}+{i}=", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"} for i in range(40)]
        extra = [*TINY_LM, "data.seq_len=32", "optim.lr=1e-2"]
    else:
        records = [{"prompt": f"{a}+{b}=", "answer": int(a + b)} for a, b in rng.integers(0, 10, (40, 2))]
        extra = ["data.seq_len=16", "data.val_percent=20", "grpo.max_completion_len=6", "grpo.group_size=4",
                 "train.batch_size=16", "train.eval_batches=1", "reward.functions=number_match,format",
                 r"reward.format_pattern=\d", "reward.weights=1,0.5", "optim.lr=1e-3"]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return ["train", "lm", "--recipe", objective, *extra, f"init.from={base}", f"data.path={data}", "train.steps=4",
            "train.eval_every=2", "checkpoint.every_steps=2", "observe.log_every=1", "observe.progress=off",
            "sample.max_new_tokens=0", "observe.tensorboard=false", "observe.plot=false", "-q"]


def post_rows(run: Path) -> list[dict]:
    """Every row without its timings (which differ between runs)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_per_s")} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_post_training_on_two_processes_matches_one_and_resumes_on_one(tmp_path, objective):
    """DPO and GRPO (its rollouts sampled in every process from the policy's current weights) on 2 processes x 1
    device write the rows of 1 process x 2 devices; stopped at step 2, the checkpoint resumes on 1 process."""
    args = post_training_args(tmp_path, objective)
    one = tmp_path / "one"
    systolic([*args, "mesh.data=2", "--run-dir", str(one)], devices=2)
    expected = post_rows(one)
    assert [r["step"] for r in expected if r["split"] == "train"] == [1, 2, 3, 4]
    two = tmp_path / "two"
    systolic(["launch", "--processes", "2", "--devices-per-process", "1", "--", *args, "mesh.data=2",
              "loop.stop_at_step=2", "--run-dir", str(two)], devices=1)
    got = post_rows(two)
    assert got == expected[:len(got)] and max(r["step"] for r in got) == 2
    systolic([*args, "mesh.data=2", "--run-dir", str(two)], devices=2)
    assert post_rows(two) == expected
