"""Run directories written by an earlier systolic still resume, and continue as that version would have.

`data/runs_f69b0f5.tar.gz` holds two runs made by commit f69b0f5 (the code before the house restructure of issue
29): `lm`, TINY_LM stopped at step 4 (`loop.stop_at_step=4`, its step-4 checkpoint), and `sim`, TINY_SIM stopped at
frame 2. The expected figures are what f69b0f5 itself printed when it resumed the same directories to the end
(step 10 / frame 75, 2026-12-05, this project's 2-core CPU machine): the new code must reach them from the old
checkpoints, which it can only do if it restores the old state layout, metadata, data position and RNG exactly.
"""

import json
import tarfile
from pathlib import Path

import pytest
from tiny import LM_CLI_QUIET, TINY_LM, TINY_SIM

from systolic.cli import main

ARCHIVE = Path(__file__).parent / "data" / "runs_f69b0f5.tar.gz"


def _unpack(tmp_path: Path) -> Path:
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path


def _last(run: Path, split: str) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split][-1]


def test_an_lm_run_of_the_previous_version_resumes_to_the_same_numbers(tmp_path, capsys):
    run = _unpack(tmp_path) / "lm"
    before = (run / "metrics.jsonl").read_text()
    assert _last(run, "train")["step"] == 4  # the archive really is a stopped run
    code = main(["train", "lm", *TINY_LM, *LM_CLI_QUIET, "checkpoint.every_steps=2", "checkpoint.async_save=false",
                 "--run-dir", str(run)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "resumed from checkpoint step 4" in out + err
    assert (run / "metrics.jsonl").read_text().startswith(before)  # its history kept as written
    train, ev = _last(run, "train"), _last(run, "eval")
    assert train["step"] == ev["step"] == 10
    assert train["loss"] == pytest.approx(5.170080661773682, rel=1e-5)
    assert ev["nats_per_byte"] == pytest.approx(5.200920904170176, rel=1e-5)


def test_a_sim_run_of_the_previous_version_resumes_to_the_same_numbers(tmp_path, capsys):
    run = _unpack(tmp_path) / "sim"
    assert _last(run, "sim")["step"] == 2
    code = main(["simulate", *[a for a in TINY_SIM if a != "-q"], "--run-dir", str(run)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "resumed from checkpoint step 2" in out + err
    last = _last(run, "sim")
    assert last["step"] == 75
    assert last["energy"] == pytest.approx(0.4356684386730194, rel=1e-5)
    assert last["enstrophy"] == pytest.approx(2.8140430450439453, rel=1e-5)
