"""Output files named by the user (systolic/outfile.py) and the CLI's error policy (cli.main, cli.entry)."""

import dataclasses
import errno
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from systolic import outfile
from systolic.cli import main
from systolic.errors import UserError


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_existing_file_is_refused_unless_forced(tmp_path):
    mine = tmp_path / "grid.png"
    mine.write_bytes(b"my picture")
    with pytest.raises(UserError, match="already exists.*--force"):
        outfile.check(mine, option="--out", suffixes=(".png",), force=False)
    assert outfile.check(mine, option="--out", suffixes=(".png",), force=True) == mine
    assert mine.read_bytes() == b"my picture"  # checking writes nothing


def test_another_kind_of_file_and_a_runs_own_files_are_refused_even_when_forced(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / ".systolic-run").write_text("{}\n")
    (run / "config.yaml").write_text("workload: rl\n")
    with pytest.raises(UserError, match=r"ending in \.gif"):
        outfile.check(run / "config.yaml", option="--gif", suffixes=(".gif",), force=True)
    with pytest.raises(UserError, match="run directory's own files"):
        outfile.check(run / "config.yaml", option="--out", suffixes=(), force=True)
    with pytest.raises(UserError, match="run directory's own files"):
        outfile.check(run / "checkpoints" / "3" / "x.jaxexport", option="--out", suffixes=(".jaxexport",), force=True)
    with pytest.raises(UserError, match="is a folder"):
        outfile.check(run, option="--out", suffixes=(), force=True)


def test_write_bytes_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "model.jaxexport"
    target.write_bytes(b"old")

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(OSError):
        outfile.write_bytes(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["model.jaxexport"]


def test_the_cli_refuses_to_overwrite_with_tokenizer_train(tmp_path, capsys):
    out = tmp_path / "tok.json"
    out.write_text('{"mine": true}')
    before = digest(out)
    code = main(["tokenizer", "train", "--vocab-size", "300", "data.max_bytes=20000", "--out", str(out)])
    assert code == 2 and "--force" in capsys.readouterr().err
    assert digest(out) == before
    assert main(["tokenizer", "train", "--vocab-size", "300", "data.max_bytes=20000", "--out",
                 str(tmp_path / "tok.yaml")]) == 2


def test_environment_errors_are_one_paragraph_and_bugs_say_so(tmp_path, monkeypatch, capsys):
    from systolic.cli import commands

    def disk_full(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(commands, "TOOLS", tuple(dataclasses.replace(c, run=disk_full) if c.name == "info" else c
                                                 for c in commands.TOOLS))
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: [Errno 28] No space left on device") and "Traceback" not in err
    monkeypatch.setenv("SYSTOLIC_DEBUG", "1")
    assert main(["info"]) == 2
    assert "Traceback" in capsys.readouterr().err  # what a bug report needs, on request

    # A bug: the real console command prints a line that says so, then the traceback; exit 1.
    code = ("import dataclasses, sys; from systolic import cli; from systolic.cli import commands; "
            "commands.TOOLS = tuple(dataclasses.replace("
            "c, run=lambda args: [][1]) if c.name == 'info' else c for c in commands.TOOLS); sys.argv = ['systolic', "
            "'info']; cli.entry()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.startswith("internal error: a bug in systolic") and "IndexError" in proc.stderr
