"""A newcomer's first hour: every command of the README blocks marked `<!-- newcomer-test ... -->` runs as written,
in order, in one fresh folder, on one CPU device, and must exit 0.

What the README assumes the reader has is made here: their notes (notes.txt, notes/, ~/notes/), multiple-choice items
and 34 conversations, all tiny; `hf download` (the network) is replaced by writing a tiny chat model's folder where it
would go. Sizes shrink through documented settings appended to the command (later overrides win): the models to a few
thousand parameters, the data to a slice of the default corpus, rows to the tiny model's context; a command whose mesh
asks for several devices gets them as the README says (XLA_FLAGS fake CPU devices); `serve` gets a free port, must
answer /v1/models, then is stopped. Plans for a TPU need libtpu (`pip install -e '.[tpu]'`) and are skipped without
it.
"""

import importlib.util
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tiny_hf import chats, make_hf_model, save_chat_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- newcomer-test"

# Appended to the commands that train or time a model from scratch: lm-tiny's shape at a few thousand parameters.
SMALL_LM = ["model.d_model=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "data.seq_len=32",
            "train.batch_size=4", "train.eval_batches=1", "data.max_bytes=300000", "data.val_percent=30",
            "observe.tensorboard=false", "observe.plot=false"]
# From an imported run the model is the source's: only the rows shrink, to the tiny model's context.
SMALL_FINE_TUNE = ["data.seq_len=64", "data.val_percent=30", "train.eval_batches=1", "observe.tensorboard=false",
                   "observe.plot=false"]
# The plans' recipes (llama-1b, llama-8b) at one small layer: the same compiles, in seconds.
SMALL_PLAN = ["model.layers=1", "model.d_model=64", "model.heads=2", "model.kv_heads=1", "model.mlp_dim=128",
              "model.vocab_size=1024", "model.max_seq_len=64", "data.seq_len=64", "train.batch_size=32"]


def readme_commands() -> list[str]:
    """The command lines of the fenced blocks that follow a newcomer-test marker, in order (comments dropped)."""
    lines, commands, marked, inside = README.read_text().splitlines(), [], False, False
    for line in lines:
        if line.startswith(MARKER):
            marked = True
        elif line.startswith("```"):
            inside = not inside and marked
            marked = False
        elif inside and line.strip():
            commands.append(line)
    return commands


def test_the_readme_marks_its_newcomer_blocks():
    commands = readme_commands()
    assert len(commands) >= 25 and commands[0].startswith("systolic train lm")
    assert any(c.startswith("hf download") for c in commands)
    assert all(c.startswith(("systolic ", "hf download ")) for c in commands), "a marked block holds only commands"


def sized(argv: list[str]) -> list[str]:
    """The documented settings that shrink `argv` (module docstring), or none."""
    command = argv[1:3]
    if command[0] == "train" and any(a.startswith("init.from=") for a in argv):
        return SMALL_FINE_TUNE
    if command in (["train", "lm"], ["bench", "lm"]):
        return SMALL_LM
    if command == ["plan", "lm"]:
        return SMALL_PLAN
    return []


def fake_devices(argv: list[str]) -> int:
    """The devices a command's mesh overrides ask for (1 without any)."""
    sizes = [int(a.split("=")[1]) for a in argv if re.fullmatch(r"mesh\.\w+=\d+", a)]
    return math.prod(sizes) if sizes else 1


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory) -> Path:
    """A fresh folder holding what the README's commands read, and a HOME with ~/notes/."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("newcomer")
    words = ("garden", "blackbird", "kettle", "morning", "trowel", "patience", "rain", "window", "letter", "bread")
    for folder in (root / "notes", root / "home" / "notes"):
        folder.mkdir(parents=True)
        for i in range(40):
            text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(300))
            (folder / f"note-{i:02d}.txt").write_text(f"Note {i}. The {text}.\n")
    (root / "notes.txt").write_text((root / "notes" / "note-00.txt").read_text() * 3)
    items = [{"context": "The capital of France is", "choices": [" Paris", " Rome"], "label": 0},
             {"context": "Two plus two is", "choices": [" five", " four"], "label": 1}]
    (root / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(34)))
    return root


def save_hf_chat_model(folder: Path) -> None:
    """What `hf download` of a chat model leaves: config.json, safetensors, tokenizer.json and the chat template."""
    make_hf_model("llama", positions=512).save_pretrained(folder)
    save_chat_tokenizer(folder)


def environment(root: Path, devices: int) -> dict[str, str]:
    # A newcomer's environment: not the test session's fake devices or strict dtype promotion (conftest.py).
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUMPY_DTYPE_PROMOTION")}
    env["HOME"] = str(root / "home")
    if devices > 1:  # as the README says for a mesh larger than the machine
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def run(root: Path, argv: list[str], devices: int = 1) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=root, env=environment(root, devices), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def serve(root: Path, argv: list[str]) -> None:
    """Starts the server on a free port, waits for /v1/models to answer, then stops it with SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(port) if previous == "--port" else a for previous, a in zip(["", *argv], argv)]
    proc = subprocess.Popen(argv, cwd=root, env=environment(root, 1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as answer:
                    assert answer.status == 200 and json.load(answer)["data"], argv
                    return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"{shlex.join(argv)} never answered /v1/models:\n{proc.communicate(timeout=60)[0][-3000:]}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~30 real CLI processes, each compiling: 10-20 minutes on a loaded 2-core CPU
def test_every_newcomer_command_of_the_readme_runs_on_one_device(newcomer):
    has_libtpu = importlib.util.find_spec("libtpu") is not None
    skipped = []
    for line in readme_commands():
        argv = shlex.split(line, comments=True)
        start = time.perf_counter()
        if argv[:2] == ["hf", "download"]:
            save_hf_chat_model(newcomer / argv[argv.index("--local-dir") + 1])  # the network's stand-in
        elif argv[:2] == ["systolic", "serve"]:
            serve(newcomer, [sys.executable, "-m", "systolic", *argv[1:]])
        elif argv[:2] == ["systolic", "plan"] and "--target" in argv and argv[argv.index("--target") + 1][0] == "v" \
                and not has_libtpu:
            skipped.append(line)
            continue
        else:
            assert argv[0] == "systolic", line
            run(newcomer, [sys.executable, "-m", "systolic", *argv[1:], *sized(argv)], devices=fake_devices(argv))
        # as it goes: `-s` shows where time went
        print(f"{time.perf_counter() - start:7.1f} s  {line[:90]}", flush=True)
    if skipped:
        print("skipped without libtpu:", *skipped, sep="\n  ")
