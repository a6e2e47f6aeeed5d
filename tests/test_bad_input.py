"""Property: any override set and any data file ends in a valid run or in exit code 2 with a one-paragraph
message, never a traceback, and a command that fails leaves existing run directories untouched."""

import contextlib
import hashlib
import io
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tiny import TINY_LM

from systolic.cli import main

BASE = [*TINY_LM, "train.steps=1", "sample.max_new_tokens=0", "observe.tensorboard=false", "observe.plot=false", "-q"]

KEYS = ["train.steps", "train.batch_size", "train.grad_accum", "train.eval_every", "train.seed", "loop.nonfinite",
        "optim.lr", "optim.b1", "optim.warmup_steps", "optim.min_lr_ratio", "mesh.data", "mesh.fsdp", "mesh.tensor",
        "sharding.rules", "data.seq_len", "data.val_percent", "data.max_bytes", "data.path", "data.tokenizer",
        "model.heads", "model.kv_heads", "model.family", "model.dtype", "checkpoint.keep", "checkpoint.every_steps",
        "observe.progress", "sample.top_p", "model.layrs", "trian.steps", "train", "optim.lr.x", "", "workload",
        "distributed.coordinator", "distributed.num_processes"]
VALUES = st.one_of(
    st.integers(-3, 40).map(str), st.integers(-(10**12), 10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.booleans().map(str),
    st.sampled_from(["", "null", "[1, 2]", "{a: 1}", "'x'", "1e-3", "-1", "llama", "gpt2", "skip", "fp8", "~",
                     "../../etc", "/nonexistent", "a=b", "\x00", "é", "0x10", "1_000"]),
    st.text(max_size=6),
)
OVERRIDE = st.one_of(st.tuples(st.sampled_from(KEYS), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"),
                     st.sampled_from(["=3", "model.", "justtext", "a..b=1", "--unknown-flag"]))
CONTENT = st.one_of(st.binary(max_size=300), st.text(min_size=1, max_size=300).map(lambda t: (t * 400).encode("utf-8", "surrogatepass")))


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def call(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
    return code, err.getvalue()


@pytest.fixture(scope="module", autouse=True)
def small_home(tmp_path_factory):
    """`data.path=~` must not read the real home directory (gigabytes of toolchains on a dev machine)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        yield


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory, corpus_dir):
    run_dir = tmp_path_factory.mktemp("existing") / "run"
    code, err = call(["train", "lm", *BASE, f"data.path={corpus_dir}", "--run-dir", str(run_dir)])
    assert code == 0, err
    return run_dir


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(overrides=st.lists(OVERRIDE, max_size=4), content=CONTENT, reuse=st.booleans(), data=st.data())
def test_random_bad_input_never_tracebacks_or_damages(existing_run, tmp_path_factory, overrides, content, reuse, data):
    work = tmp_path_factory.mktemp("example")
    corpus = work / "corpus.txt"
    corpus.write_bytes(content)
    run_dir = existing_run if reuse else work / "fresh"
    before = snapshot(existing_run)
    code, err = call(["train", "lm", *BASE, f"data.path={corpus}", *overrides, "--run-dir", str(run_dir)])
    assert "Traceback" not in err
    event(f"exit code {code}")
    if code == 0:
        return
    assert code == 2, f"exit {code}: {err}"
    assert err.strip(), "an error must come with a message"
    assert snapshot(existing_run) == before, "a failed command changed an existing run directory"
    if not reuse:
        assert not run_dir.exists(), "a failed command left a new run directory behind"
