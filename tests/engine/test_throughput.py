"""Every workload's step rows carry its throughput (`<item unit>_per_s`), in metrics.jsonl and TensorBoard: the
loop's steady-state rate of each logged window, written into the window's last row. Step 1 compiles, so its
window has no rate and its row no key."""

import json
from pathlib import Path

import pytest

from systolic.cli import main
from tiny import LM_CLI_QUIET, TINY_GAN, TINY_LM, TINY_RL, TINY_SIM

EVERY_STEP = ["observe.log_every=1", "observe.tensorboard=true", "observe.plot=false", "-q"]
RUNS = {  # workload: (command line, split of its step rows, throughput key)
    "rl": (["train", "rl", *TINY_RL], "train", "env_steps_per_s"),
    "lm": (["train", "lm", *TINY_LM, *LM_CLI_QUIET, "train.steps=4"], "train", "tokens_per_s"),
    "gan": (["train", "gan", *TINY_GAN], "train", "images_per_s"),
    "sim": (["simulate", *TINY_SIM, "sim.t_end=0.4", "output.frames=4", "output.images=false"], "sim", "steps_per_s"),
}


@pytest.mark.parametrize("workload", list(RUNS))
def test_step_rows_carry_the_throughput_after_the_compiling_step(workload, tmp_path):
    argv, split, key = RUNS[workload]
    run = tmp_path / workload
    assert main([*argv, *EVERY_STEP, "--run-dir", str(run)]) == 0
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["split"] == split}
    assert key not in rows[1], "step 1 compiled: its time is not throughput"
    later = [rows[s] for s in sorted(rows) if s >= 2]
    assert len(later) >= 3 and all(key in r and r[key] > 0 for r in later), later
    assert f"{split}/{key}" in tensorboard_tags(run)


def tensorboard_tags(run: Path) -> set[str]:
    """The scalar tags in the run's TensorBoard event files (TFRecords: length, its CRC, an Event, the Event's CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    tags = set()
    for path in (run / "tensorboard").iterdir():
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            tags |= {value.tag for value in event.summary.value}
            at += 12 + length + 4
    return tags


def test_checkpoint_saves_are_not_throughput(tmp_path, monkeypatch):
    # A save that takes 1e9 s of the loop's clock (a fake clock: no real waiting) must leave the rate alone, as an
    # evaluation does: on the chip rl-cartpole's saves once halved its reported rate (2026-12-07).
    import time
    import types

    from systolic.engine import loop

    offset = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0], monotonic=time.monotonic)
    monkeypatch.setattr(loop, "time", clock)
    save = loop._Saving.save

    def slow_save(self, state):
        save(self, state)
        offset[0] += 1e9

    monkeypatch.setattr(loop._Saving, "save", slow_save)
    run = tmp_path / "rl"
    argv, split, key = RUNS["rl"]
    assert main([*argv, *EVERY_STEP, "checkpoint.every_steps=1", "--run-dir", str(run)]) == 0
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]
    rates = [r[key] for r in rows if key in r]
    assert len(rates) >= 3 and min(rates) > 1.0, rates  # a counted save: under 1 env step/s
