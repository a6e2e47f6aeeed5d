"""The tiny rl config (tests/tiny.py) as fixtures.

Every test that trains uses exactly these settings (plus run-length and mesh choices that do not change the
compiled program), so the session's persistent compile cache compiles each program once.
"""

import json
import types
from pathlib import Path

import jax
import pytest

from systolic import config as config_lib
from systolic.config import LoopConfig, MeshConfig
from systolic.engine import loop
from systolic.runtime import mesh as mesh_lib
from systolic.workloads.rl.config import RLConfig
from tiny import TINY_RL


def tiny_rl_config(*extra: str) -> RLConfig:
    return config_lib.from_dict(RLConfig, config_lib.apply_overrides({}, [*TINY_RL, *extra]))


def loop_run(prepared, cfg, run_dir: Path, steps: int, stop_at: int = 0) -> loop.RunResult:
    settings = loop.LoopSettings(steps=steps, eval_every=steps, loop=LoopConfig(stop_at_step=stop_at),
                                 checkpoint=cfg.checkpoint, observe=cfg.observe, quiet=True)
    return loop.train(prepared.task, settings, run_dir)


def train_records(run_dir: Path) -> list[dict]:
    """The train rows without their throughput (a measurement of time, the one value a resume does not repeat)."""
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    return [{k: v for k, v in r.items() if k != "env_steps_per_s"} for r in rows]


def devices_mesh(n: int):
    return mesh_lib.make_mesh(MeshConfig(data=n, fsdp=1, tensor=1), jax.devices()[:n])


@pytest.fixture(scope="session")
def tiny_rl():
    """`tiny_rl.config(*overrides)`, `tiny_rl.mesh(n_devices)`, `tiny_rl.overrides` (for CLI runs), and for resume
    tests `tiny_rl.loop_run(prepared, cfg, run_dir, steps, stop_at)` and `tiny_rl.train_records(run_dir)`."""
    return types.SimpleNamespace(config=tiny_rl_config, mesh=devices_mesh, overrides=list(TINY_RL), loop_run=loop_run,
                                 train_records=train_records)
