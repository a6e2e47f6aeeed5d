"""Checkpoints across platforms and a bit-exact resume on the chip, through the real CLI on the tiny lm: a
checkpoint written on the chip restores on the CPU (a process of its own) to the same parameters, and one written on
the CPU (8 fake devices) restores on the chip; 8 steps straight equal 4 steps, a stop, and 4 resumed."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from tiny import LM_CLI_QUIET, TINY_LM, call

from systolic.workloads.lm.loaded_run import load_run

pytestmark = pytest.mark.tpu

# What `auto` takes on the chip (bfloat16, and XLA attention: 16 positions are no multiple of splash's 128), on both
# platforms, so that a dry check on the CPU runs the chip's program. Under standard dtype promotion, as users run:
# jax's XLA attention traces its backward pass outside the forward's own standard-promotion context, and adds float32
# statistics to bfloat16 scores there (tests/conftest.py makes promotion strict).
RUN = [*TINY_LM, *LM_CLI_QUIET, "model.dtype=bfloat16", "model.attention=xla", "train.steps=8",
       "checkpoint.every_steps=4", "checkpoint.async_save=false"]
# The newest checkpoint's parameters as NumPy arrays by tree path, saved to an .npz: the CPU side of a comparison.
LOAD = """
import sys
from pathlib import Path
import jax, numpy as np
from systolic.workloads.lm.loaded_run import load_run
params = load_run(Path(sys.argv[1]), "test").params
np.savez(sys.argv[2], **{jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)})
"""


def train(*argv: str) -> str:
    """`systolic train lm ARGV` in this process, on the chip: its stderr."""
    with jax.numpy_dtype_promotion("standard"):
        code, _, err = call("train", "lm", *argv)
    assert code == 0, err
    return err


def _params(run_dir: Path) -> dict[str, np.ndarray]:
    """The run's newest checkpoint restored in this process (on the chip), by tree path."""
    params = load_run(run_dir, "test").params
    assert {x.device.platform for x in jax.tree.leaves(params)} == {jax.default_backend()}
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}


def _params_on_cpu(on_cpu, run_dir: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    out = tmp_path / f"{run_dir.name}-cpu.npz"
    on_cpu("-c", LOAD, str(run_dir), str(out))
    with np.load(out) as f:
        return dict(f)


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_checkpoints_move_between_the_chip_and_the_cpu(tmp_path: Path, on_cpu):
    written_on_chip, written_on_cpu = tmp_path / "chip", tmp_path / "cpu"
    train(*RUN, "train.steps=4", "--run-dir", str(written_on_chip))
    on_cpu("-m", "systolic", "train", "lm", *RUN, "train.steps=4", "--run-dir", str(written_on_cpu))
    chip_run = _params(written_on_chip)
    if jax.default_backend() == "tpu":  # under SYSTOLIC_TEST_TPU_ON_CPU both runs are the CPU's and may agree
        assert any(not np.array_equal(chip_run[n], x) for n, x in _params(written_on_cpu).items()), \
            "runs on the chip and on the CPU should not end bit-equal: the comparisons below would prove nothing"
    _assert_same(_params_on_cpu(on_cpu, written_on_chip, tmp_path), chip_run)
    _assert_same(_params(written_on_cpu), _params_on_cpu(on_cpu, written_on_cpu, tmp_path))


def test_a_stopped_run_resumes_bit_exact_on_the_chip(tmp_path: Path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(*RUN, "--run-dir", str(straight))
    train(*RUN, "loop.stop_at_step=4", "--run-dir", str(resumed))
    assert _train_losses(resumed) == _train_losses(straight)[:4]
    assert (resumed / "checkpoints" / "4").is_dir()
    assert "resumed from checkpoint step 4" in train(*RUN, "--run-dir", str(resumed))
    assert _train_losses(resumed) == _train_losses(straight)  # floats from JSON: every bit
    _assert_same(_params(resumed), _params(straight))


def _train_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["split"] == "train"]
