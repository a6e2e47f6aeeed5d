"""The CLI as a user meets it: bad input ends in one paragraph and exit code 2, never a traceback."""

import subprocess
import sys

import pytest

from systolic.cli import main


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["train", "lm", "model.layrs=2"], "Did you mean 'model.layers'"),
        (["train", "lm", "train.steps=ten"], "should be an integer"),
        (["train", "lm", "mesh.data=3"], "8 available device"),
        (["train", "lm", "--recipe", "nope"], "Unknown recipe"),
        (["train", "lmm"], "Did you mean 'lm'"),
        (["generate", "/nonexistent/run"], "not a systolic run directory"),
    ],
)
def test_user_errors_exit_2_without_traceback(argv, fragment, capsys, tmp_path):
    assert main(argv + (["--run-dir", str(tmp_path / "r")] if argv[0] == "train" else [])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err.replace("\n", " ")
    assert "Traceback" not in err


def test_bad_mesh_in_a_real_process(tmp_path):
    """Through the installed entry point: a bad mesh fails before any compilation, with exit code 2."""
    proc = subprocess.run([sys.executable, "-m", "systolic", "train", "lm", "mesh.data=3", "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "does not fit the 8 available device(s)" in proc.stderr.replace("\n", " ")


def test_info_lists_devices(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "8 global devices" in out and "data=8" in out


def test_the_parser_is_built_from_declarations_alone():
    """`systolic -h` and the parse before every command read the workloads' declarations only: no jax, no model
    code (workloads/*/entry.py is imported when its command runs)."""
    code = ("import sys; from systolic import cli; cli._parser(); leaked = sorted(m for m in sys.modules if "
            "m.split('.')[0] in ('jax', 'flax', 'numpy') or m.endswith('.entry')); assert not leaked, leaked")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_help_lists_every_architecture_that_converts_and_generate_says_its_defaults(capsys):
    from systolic.workloads.lm.config import SampleConfig
    from systolic.workloads.lm.hf.architectures import ARCHITECTURES

    with pytest.raises(SystemExit):
        main(["--help"])
    listed = " ".join(capsys.readouterr().out.split())
    assert all(model_type in listed for model_type in ARCHITECTURES) and "(Llama, GPT-2)" not in listed
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed"):
        assert f"(default: the run's sample.{name}, {getattr(SampleConfig(), name)} unless" in text, name
