"""`systolic eval rl` opens the run like every other command: the newest checkpoint whose checksums verify."""

import shutil
from pathlib import Path

import pytest

from systolic.cli import main


def steps_on_disk(run: Path) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def flip_a_byte(step_dir: Path) -> None:
    """Flips one byte of the largest params file without changing its size (Orbax alone would not notice)."""
    victim = max((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def rl_run(tiny_rl, tmp_path_factory) -> Path:
    """One tiny rl run with two checkpoints, shared by this module's tests (each damages its own copy)."""
    run = tmp_path_factory.mktemp("rl") / "run"
    assert main(["train", "rl", *tiny_rl.overrides, "checkpoint.async_save=false", "observe.plot=false", "-q",
                 "--run-dir", str(run)]) == 0
    assert len(steps_on_disk(run)) == 2
    return run


def test_eval_falls_back_past_a_damaged_newest_checkpoint(rl_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(rl_run, run)
    older, newest = steps_on_disk(run)
    flip_a_byte(run / "checkpoints" / str(newest))
    capsys.readouterr()
    with pytest.warns(UserWarning, match=f"step {newest} .* is damaged"):
        assert main(["eval", "rl", str(run), "--episodes", "1"]) == 0
    assert f"checkpoint step {older};" in capsys.readouterr().out
    assert steps_on_disk(run) == [older, newest]  # evaluating reads; it moves nothing


def test_eval_with_every_checkpoint_damaged_is_a_clear_error(rl_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(rl_run, run)
    for step in steps_on_disk(run):
        flip_a_byte(run / "checkpoints" / str(step))
    capsys.readouterr()
    with pytest.warns(UserWarning, match="is damaged"):
        assert main(["eval", "rl", str(run), "--episodes", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "has no complete checkpoint" in err and "all damaged" in err and "Traceback" not in err
