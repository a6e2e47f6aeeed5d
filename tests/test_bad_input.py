"""Property: any override set and any data file ends in a valid run or in exit code 2 with a one-paragraph
message, never a traceback, and a command that fails leaves existing run directories untouched."""

import contextlib
import hashlib
import io
import os
from pathlib import Path

import numpy as np
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
    # `plan` sets XLA_FLAGS and JAX_PLATFORMS for the process it starts in (cli/plan.py); here that is a test
    # worker, whose later subprocesses (test_cli.py's) then saw one CPU device instead of eight: put them back.
    environ = dict(os.environ)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
        finally:
            os.environ.clear()
            os.environ.update(environ)
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


# FOCUSED CASES (issue 24): each names the input and the start of the paragraph the user must see ----------------


def refused(argv: list[str], *fragments: str) -> str:
    code, err = call(argv)
    assert code == 2, f"exit {code}: {err}"
    # `plan` says what it is about to do on stderr ("plan: tracing ...", issue 34's progress), then the paragraph.
    err = "\n".join(line for line in err.splitlines() if not line.startswith("plan: "))
    flat = " ".join(err.split())  # wrapped at 110 columns; a long path may start the second line
    assert "Traceback" not in err and flat.startswith("error: "), err
    for fragment in fragments:
        assert fragment in flat, flat
    return flat


@pytest.mark.parametrize("override", [
    "optim.lr=nan", "optim.eps=.inf", "optim.clip_norm=-inf", "optim.weight_decay=inf", "model.init_std=nan",
    "model.rope_theta=1e999", "sample.temperature=nan", "optim.lr=1.0e+400", "model.moe.aux_loss_weight=NaN"])
def test_non_finite_floats_are_refused_by_name(override, tmp_path):
    key = override.split("=")[0]
    refused(["train", "lm", *BASE, override, "--run-dir", str(tmp_path / "run")], f"{key}=", "is not a finite number")


@pytest.mark.parametrize("command, override", [
    (["simulate"], "navier_stokes.viscosity=nan"), (["simulate"], "sim.t_end=inf"), (["fit", "sim"], "fit.noise=nan"),
    (["train", "rl"], "ppo.lr=nan"), (["train", "gan"], "optim.lr=inf")])
def test_non_finite_floats_are_refused_in_every_workload(command, override, tmp_path):
    refused([*command, override, "--run-dir", str(tmp_path / "run"), "-q"], "is not a finite number")


@pytest.mark.parametrize("command, key", [
    (["train", "lm", *BASE], "train.seed"), (["train", "lm", *BASE], "sample.seed"), (["train", "gan"], "train.seed"),
    (["train", "rl"], "rl.seed"), (["simulate"], "sim.seed")])
@pytest.mark.parametrize("seed", [2**32, 2**63, 2**64, -1])
def test_seeds_out_of_range_are_refused(command, key, seed, tmp_path):
    refused([*command, f"{key}={seed}", "--run-dir", str(tmp_path / "run"), "-q"], f"{key}={seed}")


def test_seed_options_of_finished_run_commands_are_bounded(tmp_path):
    for argv in (["sample", "gan", str(tmp_path), "--seed", str(2**64)], ["eval", "rl", str(tmp_path), "--seed", "-5"]):
        refused(argv, "--seed=", "is not a usable seed")


def test_duplicate_yaml_keys_are_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("workload: lm\ntrain:\n  steps: 5\n  batch_size: 8\n  steps: 7\n")
    refused(["train", "lm", "--recipe", str(recipe), "--run-dir", str(tmp_path / "run")],
            "the key 'steps' appears twice", "lines 3 and 5")


@pytest.mark.parametrize("text, fragment", [
    ("a: &x [1, 2]\nb: *x\n", "uses a YAML alias"),
    ("a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n", "alias"),
    ("train:\n  <<: {steps: 3}\n", "merge key"),
    ("x: " + "[" * 5000 + "]" * 5000 + "\n", "nests more than"),
    ("{" * 100000, "nests more than"),
    ("x: 1\n" + "#" * (2 << 20) + "\n", "bytes; a config file is expected to be under"),
    ("x: \x00\n", "NUL byte"),
    ("- 1\n- 2\n", "not a mapping of config sections"),
    ("train: {steps: [", "Could not parse"),
])
def test_hostile_recipe_files_are_refused_fast(text, fragment, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    refused(["train", "lm", "--recipe", str(recipe), "--run-dir", str(tmp_path / "run")], fragment)


def test_recipe_that_is_a_device_is_refused(tmp_path):
    refused(["train", "lm", "--recipe", "/dev/zero.yaml"], "/dev/zero.yaml does not exist")
    fifo = tmp_path / "pipe.yaml"
    import os

    os.mkfifo(fifo)
    refused(["train", "lm", "--recipe", str(fifo)], "does not exist")


def test_duplicate_mesh_axis_is_refused():
    refused(["plan", "lm", "--recipe", "lm-tiny", "--target", "h100", "--mesh", "data=2,data=4"],
            "sets the data axis twice")


@pytest.mark.parametrize("argv, fragments", [
    (["train", "lm", *BASE, "model.d_model=10000000", "model.heads=4"], ["Training this lm", "needs at least", "model.d_model"]),
    (["train", "lm", *BASE, "model.moe.experts=1000000", "model.moe.top_k=2", "model.d_model=512", "model.heads=8"],
     ["model.moe.experts=1000000", "cannot fit"]),
    (["train", "lm", *BASE, "model.layers=100000"], ["model.layers=100000 is more than 1024 layers"]),
    (["simulate", "grid.n=100000000", "-q"], ["grid.n=100000000", "needs at least", "lower grid.n"]),
    (["simulate", "--recipe", "sim-taylor-green-3d", "grid.n=100000", "-q"], ["in 3 dimensions", "cannot fit"]),
    (["fit", "sim", "--recipe", "sim-viscosity-inverse", "grid.n=1000000", "-q"], ["grid.n=1000000", "cannot fit"]),
])
def test_sizes_past_memory_are_refused_before_tracing(argv, fragments, tmp_path):
    import time

    start = time.perf_counter()
    refused([*argv, "--run-dir", str(tmp_path / "run")], *fragments)
    assert time.perf_counter() - start < 20, "the size check must come before tracing"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--target", "h100", "--mesh", "fsdp=100000"], "asks for 100,000 devices"),
    (["--target", "h100", "--mesh", "data=3000,tensor=3000"], "asks for 9,000,000 devices"),
    (["--target", "h100", "--mesh", "fsdp=8", "model.d_model=1000000", "model.heads=4"], "8 x NVIDIA H100"),
])
def test_plan_refuses_absurd_meshes_and_models_fast(args, fragment):
    import time

    start = time.perf_counter()
    refused(["plan", "lm", "--recipe", "lm-tiny", *args], fragment)
    assert time.perf_counter() - start < 20


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tiny_files import write_hf_folder

    return write_hf_folder(tmp_path_factory.mktemp("hf") / "tiny")


def broken_copy(src: Path, dst: Path, change) -> Path:
    import shutil

    shutil.copytree(src, dst)
    change(dst)
    return dst


def edit_config(**changes):
    import json

    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return change


def write(name: str, data: bytes | str):
    def change(folder: Path) -> None:
        (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return change


def test_tiny_hf_folder_converts(hf_folder, tmp_path):
    code, err = call(["convert", "from-hf", str(hf_folder), str(tmp_path / "run")])
    assert code == 0, err


def _header(header: dict, data: bytes = b"") -> bytes:
    import json
    import struct

    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("change, fragments", [
    (write("config.json", "[1, 2]"), ["config.json holds a JSON array, not an object"]),
    (write("config.json", "{"), ["config.json: it is not valid JSON"]),
    (write("config.json", "[" * 100000), ["config.json"]),
    (write("config.json", '{"model_type": ["llama"]}'), ["model_type ['llama']"]),
    (edit_config(hidden_size="32"), ["hidden_size = '32'; expected a positive integer"]),
    (edit_config(num_attention_heads=0), ["num_attention_heads = 0; expected a positive integer"]),
    (edit_config(num_hidden_layers=100000), ["num_hidden_layers = 100000", "at most 1024 layers"]),
    (edit_config(hidden_size=10**7, intermediate_size=10**7), ["needs at least", "cannot fit"]),
    (edit_config(rms_norm_eps=None, rope_theta="fast"), ["rope_theta = 'fast'; expected a finite number"]),
    (write("config.json", '{"model_type": "llama", "rms_norm_eps": NaN}'), ["NaN, which is not a JSON number"]),
    (edit_config(rope_parameters=[1]), ["rope_parameters = [1]"]),
    (edit_config(num_key_value_heads=3), ["config.json describes a model systolic cannot build", "kv_heads"]),
    (write("model.safetensors", b"garbage!garbage"), ["model.safetensors is not a valid safetensors file", "header claims"]),
    (write("model.safetensors", b"\x01"), ["shorter than the 8-byte header length"]),
    (write("model.safetensors", (2**62).to_bytes(8, "little")), ["header claims 4,611,686,018,427,387,904 bytes"]),
    (write("model.safetensors", _header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)),
     ["data_offsets [0, 16]", "truncated"]),
    (write("model.safetensors", _header({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)),
     ["dtype 'F99'"]),
    (write("model.safetensors", _header({"a": [1]})), ["tensor 'a' is described by [1]"]),
    (write("model.safetensors.index.json", '{"weight_map": {"x": "../other/model.safetensors"}}'),
     ["points at '../other/model.safetensors'", "not a file name inside"]),
    (write("model.safetensors.index.json", '{"weight_map": {"x": "/etc/passwd"}}'), ["points at '/etc/passwd'"]),
    (write("model.safetensors.index.json", '{"weight_map": [1]}'), ["weight_map = [1]"]),
])
def test_bad_hf_folders_are_refused_naming_the_file(hf_folder, tmp_path, change, fragments):
    src = broken_copy(hf_folder, tmp_path / "src", change)
    refused(["convert", "from-hf", str(src), str(tmp_path / "run")], *fragments)
    assert not (tmp_path / "run").exists()


def _rewrite_tensors(transform):
    def change(folder: Path) -> None:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        save_file({k: transform(k, v) for k, v in tensors.items()}, folder / "model.safetensors")
    return change


@pytest.mark.parametrize("change, fragments", [
    (_rewrite_tensors(lambda k, v: v * np.nan if "up_proj" in k else v), ["holds 4,096 NaN or infinite values"]),
    (_rewrite_tensors(lambda k, v: v.astype(np.int8) if "q_proj" in k else v), ["not floating point", "(I8)"]),
])
def test_nan_or_integer_weights_are_refused(hf_folder, tmp_path, change, fragments):
    src = broken_copy(hf_folder, tmp_path / "src", change)
    refused(["convert", "from-hf", str(src), str(tmp_path / "run")], *fragments)


@pytest.mark.parametrize("name, content, fragments", [
    ("corpus.parquet", b"not parquet at all, just text\n" * 50, ["named like a Parquet file but cannot be read"]),
    ("corpus.parquet", b"PAR1" + b"\0" * 100 + b"PAR1", ["named like a Parquet file"]),
    ("corpus.jsonl", b'{"text": ' + b"[" * 100000 + b"\n", ["line 1 is not valid JSON"]),
    ("corpus.jsonl", b'{"text": 1' + b"0" * 5000 + b"}\n", ["line 1 is not valid JSON"]),
])
def test_data_files_that_are_not_what_their_name_says_are_refused(name, content, fragments, tmp_path):
    path = tmp_path / name
    path.write_bytes(content)
    refused(["train", "lm", *BASE, f"data.path={path}", "--run-dir", str(tmp_path / "run")], str(path), *fragments)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, content, fragment", [
    ("corpus.jsonl.gz", b"\x1f\x8b\x08\x00garbage", "gzip-compressed JSON Lines"),
    ("corpus.parquet", b"PAR1 not really", "named like a Parquet file"),
    ("corpus.arrow", b"ARROW1 not really", "named like an Arrow file"),
])
def test_data_prepare_refuses_damaged_record_files(name, content, fragment, tmp_path):
    path = tmp_path / name
    path.write_bytes(content)
    refused(["data", "prepare", str(path), "--out", str(tmp_path / "out"), "--workers", "1"], fragment)
    assert not (tmp_path / "out").exists()


def test_data_prepare_refuses_a_device(tmp_path):
    refused(["data", "prepare", "/dev/urandom", "--out", str(tmp_path / "out")], "is a character device")


@pytest.mark.parametrize("device", ["/dev/urandom", "/dev/zero"])
def test_character_devices_as_data_are_refused(device, tmp_path):
    refused(["train", "lm", *BASE, f"data.path={device}", "data.max_bytes=1000000", "--run-dir", str(tmp_path / "r")],
            f"data.path='{device}' is a character device")


def test_fifo_as_data_is_refused(tmp_path):
    import os

    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    refused(["train", "lm", *BASE, f"data.path={fifo}", "--run-dir", str(tmp_path / "r")], "is a FIFO (named pipe)")


def test_reading_stops_at_max_bytes_and_keeps_whole_characters(tmp_path):
    from systolic.data import corpus

    path = tmp_path / "big.txt"
    path.write_bytes("é".encode() * 3_000_000)  # 6 MB of 2-byte characters
    (doc,) = corpus.read_documents(str(path), max_bytes=1001)
    assert doc.text == "é" * 500  # the 1001st byte would cut a character: left out, not a decode failure


def test_generate_refuses_a_nul_prompt_and_non_finite_settings(existing_run):
    before = snapshot(existing_run)
    refused(["generate", str(existing_run), "--prompt", "a\x00b"], "--prompt) holds a NUL byte at character 1")
    refused(["generate", str(existing_run), "--temperature", "nan"], "temperature=nan")
    refused(["generate", str(existing_run), "--seed", str(2**64)], "sample.seed=18446744073709551616")
    assert snapshot(existing_run) == before


def test_an_edited_run_config_with_an_absurd_model_is_refused_before_tracing(existing_run, tmp_path):
    import shutil
    import time

    run = tmp_path / "edited"
    shutil.copytree(existing_run, run)
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("d_model: 32", "d_model: 40000000"))
    start = time.perf_counter()
    refused(["generate", str(run), "--prompt", "x"], "config.yaml", "needs at least")
    assert time.perf_counter() - start < 20


@pytest.mark.parametrize("manifest", ['[1, 2]', '"x"', '{"a": 1}', '{"../../etc/passwd": "00"}', "[" * 100000, "1" * 5000])
def test_checkpoint_manifests_of_the_wrong_shape_count_as_damage(existing_run, tmp_path, manifest):
    import shutil

    from systolic.engine.checkpoint import MANIFEST

    run = tmp_path / "run"
    shutil.copytree(existing_run, run)
    for path in (run / "checkpoints").glob(f"*/{MANIFEST}"):
        path.write_text(manifest)
    refused(["generate", str(run), "--prompt", "x"], "has no complete checkpoint", "are all damaged")


@pytest.mark.parametrize("override", ["train.steps=1000000000000000000000000000000", "model.d_model=1.0e+300",
                                      "checkpoint.keep=-99999999999999999999999"])
def test_integers_past_int64_are_refused(override, tmp_path):
    refused(["train", "lm", *BASE, override, "--run-dir", str(tmp_path / "run")], "outside the range of a 64-bit integer")


@pytest.mark.parametrize("override", ["rl.num_envs=1000000000", "model.hidden=10000000"])
def test_rl_runs_past_memory_are_refused_before_tracing(override, tmp_path):
    refused(["train", "rl", override, "ppo.num_minibatches=1", "--run-dir", str(tmp_path / "run"), "-q"],
            "This rl run", "needs at least", "cannot fit")


@pytest.mark.parametrize("override", ["model.g_channels=10000000", "gan.eval_samples=100000000000"])
def test_gan_runs_past_memory_are_refused_before_allocating(override, tmp_path):
    refused(["train", "gan", override, "--run-dir", str(tmp_path / "run"), "-q"], "This gan", "cannot fit")


# ROUND FOUR (issue 45): unbounded sizes, zero and empty values, writing inside a run, RoPE that divides by zero -----


def test_serve_and_generate_sizes_are_bounded_by_the_context_before_anything_is_loaded(existing_run):
    """Each refused in one paragraph before the weights are read or anything compiled; the run byte-identical."""
    before = snapshot(existing_run)
    run = str(existing_run)
    for flags, fragment in ((["--page-size", "0"], "--page-size 0: a page holds 1 to"),
                            (["--page-size", "1000000"], "--page-size 1000000"),
                            (["--mesh-tensor", "0"], "--mesh-tensor 0"),
                            (["--max-seqs", "0"], "--max-seqs 0"),
                            (["--max-seqs", "100000000"], "--max-seqs 100000000"),
                            (["--max-tokens-per-step", "1000000000"], "--max-tokens-per-step 1000000000: a step holds"),
                            (["--max-tokens-per-step", "2"], "at least one token of each of --max-seqs 16")):
        refused(["serve", run, "--port", "0", *flags], fragment, "Fix:")
    refused(["generate", run, "--max-new-tokens", "1000000000"], "Cannot generate 1,000,000,000 tokens",
            "--max-new-tokens")
    assert snapshot(existing_run) == before


def test_plan_serve_refuses_zero_empty_and_unbounded_values():
    plan = ["plan", "lm", "--recipe", "lm-tiny", "--target", "h100", "--serve"]
    for flags, fragment in ((["--context", "0"], "--context 0: expected a positive number"),
                            (["--prefill-tokens", "0"], "--prefill-tokens 0: expected a positive number"),
                            (["--batch", "1000000000"], "--batch 1000000000: a decode step holds at most 1,024"),
                            (["--weights", ",,,"], "--weights ',,,' names no format"),
                            (["--weights", ""], "--weights '' names no format"),
                            (["--kv", " , "], "--kv ' , ' names no format")):
        refused([*plan, *flags], fragment, "Fix:")


def test_outputs_inside_a_run_directory_are_refused_and_the_run_is_unchanged(existing_run, hf_folder, tmp_path):
    """`quantize --out RUN/checkpoints/999` and `convert from-hf SRC RUN/checkpoints/777` once exited 0 and left the
    run unreadable; every command that creates a folder at a path the user names refuses one inside a run."""
    before = snapshot(existing_run)
    run = existing_run
    refused(["quantize", str(run), "--scheme", "int8", "--out", str(run / "checkpoints" / "999")],
            "is inside the run directory", "Fix:")
    refused(["quantize", str(run), "--scheme", "int8", "--out", str(run / "q")], "is inside the run directory")
    refused(["convert", "from-hf", str(hf_folder), str(run / "checkpoints" / "777")], "is inside the run directory")
    refused(["convert", "to-hf", str(run), str(run / "hf")], "is inside the run directory")
    refused(["data", "arithmetic", "--out", str(run / "checkpoints" / "data")], "is inside the run directory")
    corpus = tmp_path / "notes.txt"
    corpus.write_text("hello world\n" * 100)
    refused(["data", "prepare", str(corpus), "--out", str(run / "checkpoints" / "prepared")],
            "is inside the run directory")
    assert snapshot(existing_run) == before
    assert not any(p.name.startswith(".") and p.name != ".systolic-run" and p.name != ".lock"
                   for p in run.iterdir()), sorted(run.iterdir())


@pytest.mark.parametrize("overrides, fragment", [
    (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.original_max_seq_len=16",
      "model.rope_theta=1"], "dividing by ln(rope_theta)"),
    (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.original_max_seq_len=16",
      "model.rope_theta=0.5"], "model.rope_theta=0.5 with model.rope_scaling.type=yarn"),
    (["model.rope_scaling.type=longrope", "model.rope_scaling.factor=4", "model.rope_scaling.original_max_seq_len=1",
      "model.rope_scaling.short_factor=[1,1,1,1]", "model.rope_scaling.long_factor=[2,2,2,2]"],
     "divides by ln(1) = 0"),
])
def test_rope_settings_that_divide_by_zero_are_refused_at_load(overrides, fragment, tmp_path):
    refused(["train", "lm", *BASE, *overrides, "--run-dir", str(tmp_path / "run")], fragment, "Fix:")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change, fragment", [
    (edit_config(rope_theta=1, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 16}), "dividing by ln(rope_theta)"),
    (edit_config(original_max_position_embeddings=1, rope_scaling={"type": "longrope", "short_factor": [1.0] * 4,
                                                                   "long_factor": [2.0] * 4}), "divides by ln(1) = 0"),
])
def test_rope_settings_that_divide_by_zero_are_refused_at_import(hf_folder, tmp_path, change, fragment):
    src = broken_copy(hf_folder, tmp_path / "src", change)
    refused(["convert", "from-hf", str(src), str(tmp_path / "run")], fragment, "config.json")
    assert not (tmp_path / "run").exists()

