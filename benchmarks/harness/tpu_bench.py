"""The parts of `benchmarks/harness/tpu.sh` on one TPU v5e chip, one program on the chip at a time: the `tpu` tests, the
training rows (step time, tokens/s and MFU of `systolic bench lm`), the inference engine's tokens/s (bfloat16, then
quantized), PPO against PureJaxRL's ppo.py (the recipe and 2,048 environments x 8 seeds), 2-D turbulence against
jax-cfd and the 3-D DNS step's FFT share, and the gan-dcgan-64 recipe's throughput and MFU. tpu.sh installs the
carried wheels and sets PYTHONPATH before it runs this.

    bash benchmarks/harness/tpu.sh [test|train|serve|serve-int8|serve-steps|rl|sim|gan ...]    # default: all
    SYSTOLIC_TPU_SH_DRY_RUN=1 bash benchmarks/harness/tpu.sh         # anywhere: the same parts, tiny models on CPU

One command on the lent machine may run 10 minutes: the parts share a budget of SYSTOLIC_TPU_SH_BUDGET_S (default
480 s), each part at most its own (PART_BUDGET_S), so any one part, or `test train`, ends inside it. A row that
would start with too little left is reported "skipped: budget". MFU is against the data sheet's 197 TFLOP/s bf16
peak of a v5e ('TPU v5 lite' in observe/peak_flops.py; an 8192^3 bf16 matmul measured 181 there, 2026-12-06).
Output in $OUT (default /tmp/tpu-bench): tpu-bench.txt (the table), tpu-bench.jsonl (one line per row),
tpu-bench.log (every process's output), pytest.xml (the tests, with their measured errors as properties),
serve-engine.jsonl, sim.jsonl: six files of the eight that come back.

Exit codes: 0 every row that ran succeeded; 1 a row failed (the table and the log say which); 2 JAX sees no TPU
(and no dry run was asked for).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_rows import Row, error_line, format_table, preflight, run_bench_row, run_command  # sys.path[0]

# The scripts that the parts run, from the repository root (tpu.sh's working directory), each in its room.
SERVE_ENGINE = "benchmarks/studies/serve_engine.py"
RL_VS_PUREJAXRL = "benchmarks/peers/rl_vs_purejaxrl.py"
SIM_VS_JAX_CFD = "benchmarks/peers/sim_vs_jax_cfd.py"
DNS3D_FFT_SHARE = "benchmarks/studies/dns3d_fft_share.py"

DRY_RUN_ENV = "SYSTOLIC_TPU_SH_DRY_RUN"
BUDGET_ENV = "SYSTOLIC_TPU_SH_BUDGET_S"
TOTAL_S = 480.0  # of a command's 10 minutes; the rest: the wheels' install, matplotlib's from the machine's index
PARTS = ("test", "train", "serve", "serve-int8", "serve-steps", "rl", "sim", "gan")
PART_BUDGET_S = {"test": 300.0, "train": 480.0, "serve": 420.0, "serve-int8": 420.0, "serve-steps": 480.0,
                 "rl": 450.0, "sim": 420.0,
                 "gan": 180.0}
MIN_ROW_S = 60.0  # a row never starts with less: opening the chip takes ~15 s and a compile tens of seconds
PACKAGES = ("jax", "jaxlib", "libtpu", "flax", "optax", "orbax-checkpoint", "grain", "qwix", "gymnax", "matplotlib",
            "scikit-learn", "pillow", "numpy")

# The training rows, in order. Measured on the chip 2026-12-06 before this harness (NOTES-jax-stack.md): gpt2-124m
# 32 x 1024 46.7% MFU, 284 ms a step; llama-1b cut to 8 layers, 4 x 2048, remat=dots 40.4%; 8 x 2048 with remat=dots
# ran out of the chip's 15.75 GiB. Batches are the largest that fit (the compiled step's memory analysis on the chip,
# explore runs of 2026-12-06): gpt2-124m 14.6 GiB at 32 x 1024 (its float32 logits: 6.6 GB); llama-1b/8 layers
# 16.3 GiB at 4 x 2048 with remat=dots (8 x 2048: 17.8 GiB); the whole llama-1b at 4 x 2048 with bf16
# moments and remat=context (temporaries 9.9 GiB) or remat=full (8.1 GiB). batch_size None: the recipe's own.
TRAIN_ROWS = (
    Row("gpt2-124m", "gpt2-124m", batch_size=32, seq_len=1024, steps=20, attention="splash", scan_layers=False,
        timeout_s=180),
    Row("llama-1b 8 layers", "llama-1b", batch_size=4, seq_len=2048, steps=12, attention="splash", scan_layers=True,
        timeout_s=150, extra=("model.layers=8", "model.remat=dots")),
    # The same 0.5B Llama with 16 heads of 128 (OLMo-1B's and Llama 2's head size) instead of 32 of 64: the matrix
    # unit is 128 wide, and splash's softmax work per FLOP halves.
    Row("llama 8 layers hd128", "llama-1b", batch_size=4, seq_len=2048, steps=12, attention="splash",
        scan_layers=True, timeout_s=150, extra=("model.layers=8", "model.heads=16", "model.kv_heads=8",
                                                "model.remat=dots")),
    # The whole model in 15.75 GiB: bf16 optimizer moments, and each layer keeps only its attention's output and
    # statistics (remat=context, the recipe): the kernel's forward does not run again in the backward pass.
    Row("llama-1b-v5e", "llama-1b-v5e", batch_size=None, seq_len=2048, steps=6, attention="splash",
        scan_layers=True, timeout_s=170),
    # ... keeping nothing but each layer's input (remat=full): 1.8 GiB fewer temporaries, every forward runs again.
    Row("llama-1b-v5e full", "llama-1b-v5e", batch_size=None, seq_len=2048, steps=6, attention="splash",
        scan_layers=True, timeout_s=170, extra=("model.remat=full",)),
)
# The serving rows (SERVE_ENGINE, random weights, greedy, 128-token prompts): (label, arguments). Cold
# warm-ups measured 2026-12-06 (commit b067cb5): 47 s (llama-1b), 62 s (gemma3-1b), 68 s (the Gemma-2B shape); 8 s
# warm (llama-1b). Since 2026-12-07 a step holds 4 x --max-seqs tokens by default (1,024 for the rows of 256): 76 s
# cold for llama-1b (more step sizes); 15 s for its 256-token programs from the cache.
BF16 = ["--dtype", "bfloat16"]
SERVE_ROWS = (
    ("llama-1b bfloat16 (head_dim 64)", ["--recipe", "llama-1b", *BF16, "--levels", "1,16,64,256", "--max-seqs", "256",
                                         "--output", "128"]),
    # 512 tokens a step (the default for 64 sequences is 256): 8,179 tok/s at 64 (2026-12-07, third session; 7,979
    # before a greedy step stopped building the banned-id mask), 7,212 with 256 (2026-12-06).
    ("gemma3-1b bfloat16 (head_dim 256)", ["--recipe", "gemma3-1b", *BF16, "--levels", "1,64", "--max-seqs", "64",
                                           "--output", "64", "--max-tokens-per-step", "512"]),
    # Gemma 2B's shape (18 x 2048, 8 heads of 256, one key/value head, GeGLU 16384, 256,000 ids): JetStream's row.
    ("Gemma-2B shape bfloat16", ["--recipe", "llama-1b", *BF16, "--levels", "64,256", "--max-seqs", "256", "--output",
                                 "128", "--set", "model.layers=18", "model.heads=8", "model.kv_heads=1",
                                 "model.head_dim=256", "model.mlp_dim=16384", "model.vocab_size=256000",
                                 "model.mlp_activation=gelu_tanh"]),
)
SERVE_DRY = (("4 x 256 llama float32", ["--levels", "1,4", "--prompt", "32", "--output", "16", "--max-seqs", "4",
                                         "--max-tokens-per-step", "64"]),)  # its default model
# Quantized weights (issue 42), drawn quantized (serve_engine.py random_params: no float copy of the model). First
# w8a8 (int8 x int8 dots) against bfloat16 on llama-1b, each row as serve's llama-1b row but for the weights and the
# levels (its own bf16 row here, so that one command gives the ratio; the acceptance: w8a8 >= 1.3x at 256): 1.28x at
# 64 and 1.21x at 256 (2026-12-07, third session; 1.21x and 1.11x when the weights' scales were float32 and the TPU
# compiler copied each layer's int8 weight slices into on-chip memory before their dots); with the int8 KV pool read
# by the kernel and written by DMA (kernels/kv_write.py), 1.33x at 256 (2026-12-07, seventh session). Then a
# Llama-3-8B shape, which fits one v5e only so: 7.97 GiB of int8 weights (bf16: 14.96 GiB of the chip's 15.75), its
# cache in int8 (67,584 bytes a token against 131,072): 256 sequences of 128 + 128 tokens take 4.13 GiB. The TPU
# compiler's figure for that step (`systolic plan lm --serve --recipe llama-8b --target v5e-1 --weights int8 --kv
# int8 --context 256 --batch 256 --prefill-tokens 16`, libtpu 0.0.42.1, 2026-12-06): 13.33 GiB, of it 1.21 GiB
# temporaries. The pool is set to 4.5 GiB: the default (80% of what the weights leave, ~6.1 GiB) would bring the
# step to ~15.3 GiB. Per row: ~15 s to open the chip, warm-ups of 72-84 s (llama-1b, 2026-12-07), llama-8b's
# weights drawn on the host (53 s on this project's loaded 2-core CPU host) and its warm-up 93-95 s. Its int8 pool
# is read by the kernel (heads of 128): through the plain path its 1,024-token step needed 16.65 GiB (2026-12-07).
# It ran 77.7 ms a token at 1 in flight and 565 tok/s at 64 (TPOT 102 ms); a level of 256 would not fit the part.
LLAMA_1B_256 = ["--recipe", "llama-1b", *BF16, "--levels", "64,256", "--max-seqs", "256", "--output", "128"]
SERVE_INT8_ROWS = (
    ("llama-1b w8a8, int8 KV", [*LLAMA_1B_256, "--quantize", "w8a8", "--kv-cache", "int8"]),
    ("llama-1b bfloat16", LLAMA_1B_256),
    ("Llama-3-8B shape int8 weights, int8 KV", ["--recipe", "llama-8b", *BF16, "--quantize", "int8", "--kv-cache",
                                                "int8", "--kv-memory-gib", "4.5", "--levels", "1,64",
                                                "--max-seqs", "256", "--output", "128"]),
)
# One row, both int8 paths (weights drawn quantized, int8 cache), with fewer step sizes than SERVE_DRY's (16-token
# steps): its warm-up is most of its CPU time (49 s of 61 on this project's 2-core host).
SERVE_INT8_DRY = (("4 x 256 llama w8a8, int8 KV", ["--levels", "1,4", "--prompt", "32", "--output", "16", "--max-seqs",
                                                   "4", "--max-tokens-per-step", "16", "--quantize", "w8a8",
                                                   "--kv-cache", "int8"]),)
# How many tokens a step may take (`--max-tokens-per-step`, issue 42). At 256 requests in flight the default 256 leaves
# a step no room for prompt tokens once every sequence decodes, and 256 prompts of 128 tokens take 128 steps of
# their own: at 256 in flight llama-1b ran 9,422 output tok/s over the whole run at TPOT 13.1 ms (256 / 13.1 ms
# would be 19,500), 2026-12-06. Rows in the order of what they decide, each to its own check: llama-1b in bfloat16
# with 1,024 tokens a step (TPOT at 1, tok/s at 64 and 256), the same at the default 256 (its step sizes are a subset:
# a warm cache), w8a8 with 1,024 at 64 and 256 (the ratio to the first row), gemma3-1b at 512 (1 and 64), then the
# Llama-3-8B shape with int8 weights at 1 and 64 (the weight-only dot of commit "weight-only int8: the scales after
# the dot"; it took 51 ms a token at 1 in flight before).
LLAMA_1B_BF16 = ["--recipe", "llama-1b", *BF16, "--max-seqs", "256", "--output", "128"]
SERVE_STEPS_ROWS = (
    ("llama-1b bfloat16 1024 tokens a step", [*LLAMA_1B_BF16, "--levels", "1,64,256", "--max-tokens-per-step", "1024"]),
    ("llama-1b bfloat16 256 tokens a step", [*LLAMA_1B_BF16, "--levels", "64,256", "--max-tokens-per-step", "256"]),
    ("llama-1b w8a8, int8 KV, 1024 tokens a step", [*LLAMA_1B_BF16, "--quantize", "w8a8", "--kv-cache", "int8",
                                                    "--levels", "64,256", "--max-tokens-per-step", "1024"]),
    ("gemma3-1b bfloat16 512 tokens a step", ["--recipe", "gemma3-1b", *BF16, "--levels", "1,64", "--max-seqs", "64",
                                              "--output", "64", "--max-tokens-per-step", "512"]),
    ("Llama-3-8B shape int8 weights, int8 KV", ["--recipe", "llama-8b", *BF16, "--quantize", "int8", "--kv-cache",
                                                "int8", "--kv-memory-gib", "4.5", "--levels", "1,64", "--max-seqs",
                                                "256", "--output", "128"]),
)
SERVE_STEPS_DRY = (("4 x 256 llama float32, 128 tokens a step", ["--levels", "1,4", "--prompt", "32", "--output", "16",
                                                                 "--max-seqs", "4", "--max-tokens-per-step", "128"]),)
WARMUP = re.compile(r"warm-up \(every step size compiled\): ([\d.]+) s")
# PPO on CartPole (issue 43): RL_VS_PUREJAXRL, one alternated pair (systolic, then PureJaxRL's ppo.py),
# each side its own process on the chip (--platform tpu: no silent fall-back to the CPU). The wide row first (the
# figure the chip has not yet given): 2,048 environments x 8 seeds, 2 chunks of 8 updates = 4,194,304 env steps per
# seed (systolic's rate is its second chunk's); then the recipe (8 seeds x 4 environments, 507,904 env steps per
# seed: ~80k env steps/s a side on the chip, 2026-12-06, so ~100 s a side with opening the chip and compiling).
# (label, overrides, dry-run overrides)
RL_ROWS = (
    ("PPO 2048 envs x 8 seeds", ["rl.num_envs=2048", "rl.updates_per_chunk=8", "rl.total_env_steps=4194304"],
     ["rl.num_seeds=2", "rl.num_envs=32", "rl.num_steps=8", "rl.updates_per_chunk=2", "rl.total_env_steps=2048",
      "rl.eval_episodes=2"]),
    ("PPO rl-cartpole (8 seeds x 4 envs)", [],
     ["rl.num_seeds=2", "rl.num_envs=8", "rl.num_steps=8", "rl.updates_per_chunk=2", "rl.total_env_steps=512",
      "rl.eval_episodes=2"]),
    # The recipe with its rollout unrolled 8 steps per loop iteration (rl.unroll: on the chip each iteration of the
    # 128-step rollout is latency-bound, issue 43), for a quarter of the experience (16 chunks, 131,072 env steps per
    # seed) so the part stays within its budget; both rates are steady-state, so they compare with the row above.
    ("PPO rl-cartpole, rl.unroll=8", ["rl.unroll=8", "rl.total_env_steps=131072"],
     ["rl.num_seeds=2", "rl.num_envs=8", "rl.num_steps=8", "rl.updates_per_chunk=2", "rl.total_env_steps=512",
      "rl.eval_episodes=2", "rl.unroll=3"]),
)
# The solvers in float32 (the chip has no float64 FFT), issue 43. First, each its own process, appending to
# $OUT/sim.jsonl: 2-D turbulence on 1024^2 against jax-cfd's spectral solver (SIM_VS_JAX_CFD, same
# field, viscosity and dt; 1,000 steps a side: ~2.5 s of systolic at the 395 steps/s that `systolic simulate` ran
# there, 2026-12-06), then the 3-D Taylor-Green DNS step at 128^3 and 256^3 with its FFTs' share and their memory
# roofline (DNS3D_FFT_SHARE). The TPU compiler expands every FFT: on this project's loaded 2-core host
# (libtpu AOT, 2026-12-06) it took 322 s for systolic's 1024^2 frame, 261 s for jax-cfd's program, 128 s for the
# 128^3 DNS frame, 68 s and 132 s for the 128^3 and 256^3 FFT programs. Each script compiles its two programs at
# once and caches them (.jax-cache: a second `tpu.sh sim` on a warm machine skips the compiler), and the part's
# budget is 420 s, not 300: the 256^3 row is the one that may still not fit a cold first call.
# (label, script, arguments, dry-run arguments)
SIM_BENCH_ROWS = (
    ("2-D turbulence 1024^2 vs jax-cfd", SIM_VS_JAX_CFD, ["--sizes", "1024", "--steps", "1000"],
     ["--sizes", "64", "--steps", "4", "--repeats", "1"]),
    ("3-D Taylor-Green DNS 128^3: FFT share", DNS3D_FFT_SHARE, ["--sizes", "128", "--steps", "40"],
     ["--sizes", "16", "--steps", "2", "--repeats", "1"]),
    ("3-D Taylor-Green DNS 256^3: FFT share", DNS3D_FFT_SHARE, ["--sizes", "256", "--steps", "10"],
     ["--sizes", "32", "--steps", "2", "--repeats", "1"]),
)
# Then, if the budget leaves time, the CLI's own figure: 2-D decaying turbulence on 1024^2 (the issue's row, 395
# steps/s there, 2026-12-06) to t = 5 of the recipe's 15 (~1/3 of its CFL steps). (Taylor-Green on 512^2, run here
# before, gave way to the rows above.)
NO_PICTURES = ["output.images=false", "observe.plot=false"]
TURBULENCE = ["--recipe", "sim-turbulence", "grid.n=1024", "sim.t_end=5.0", *NO_PICTURES]
TURBULENCE_DRY = ["grid.n=32", "sim.t_end=0.5", "output.frames=4"]
# DCGAN at 64x64 (the recipe's 512-channel networks, batch 64) on the bundled digits (data.path='': scikit-learn's
# 8x8 digits resized with Pillow, one channel), evaluated once at the end. images/s, and the MFU that the run's
# throughput line adds on a chip with a data-sheet peak (none on a CPU, so none in a dry run): model FLOPs counted from
# the layer shapes (workloads/gan/flops.py: 2.926e11 a step, XLA:CPU's cost analysis 0.6% more) over the bf16 peak,
# since the float32 convolutions run as one bf16 pass at JAX's default precision.
GAN = ["--recipe", "gan-dcgan-64", "train.steps=300", "train.eval_every=100000", "checkpoint.every_steps=100000",
       "observe.plot=false"]
GAN_DRY = ["train.steps=6", "train.batch_size=8", "model.g_channels=16", "model.d_channels=16", "observe.log_every=2"]
THROUGHPUT = re.compile(r"throughput: ([\d,.]+) ([^;]+); [^;]* ([\d.]+) s; wall time ([\d.]+) s")
MFU = re.compile(r"wall time [\d.]+ s; MFU ([\d.]+)%")  # the throughput line's tail where the task counts its FLOPs


def main(argv: list[str]) -> int:
    parts = argv or list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"tpu_bench: no part {unknown[0]!r}; the parts: {', '.join(PARTS)} (default: all, in that order).",
              file=sys.stderr)
        return 2
    dry_run = os.environ.get(DRY_RUN_ENV, "") not in ("", "0", "false")
    out_dir = Path(os.environ.get("OUT") or "/tmp/tpu-bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + float(os.environ.get(BUDGET_ENV, TOTAL_S))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    info = preflight(env, PACKAGES, "run benchmarks/harness/tpu-wheels.sh where a registry is reachable and carry "
                     ".whl-tpu; tpu.sh installs it.")
    if info is None:
        return 1
    if info["backend"] != "tpu" and not dry_run:
        print(f"tpu_bench: JAX sees no TPU (backend {info['backend']!r}, devices {info['devices']}). Fix: run it on "
              f"the TPU machine, with JAX_PLATFORMS unset or tpu,cpu; or set {DRY_RUN_ENV}=1 to check the wiring on "
              "CPU with tiny models.", file=sys.stderr)
        return 2
    if dry_run:
        print(f"{DRY_RUN_ENV}: tiny models on {info['backend']}, XLA attention where the chip takes splash; the "
              "figures mean nothing")
    files = {name: out_dir / f"tpu-bench.{name}" for name in ("jsonl", "txt", "log")}
    records: list[dict] = []
    with open(files["jsonl"], "w", encoding="utf-8") as jf, open(files["log"], "w", encoding="utf-8") as lf:
        jf.write(json.dumps({"kind": "env", "dry_run": dry_run, "parts": parts, **info}) + "\n")
        for part in parts:
            part_end = min(deadline, time.monotonic() + PART_BUDGET_S[part])
            for record in PART_RUNNERS[part](dry_run, env, part_end, lf, out_dir):
                records.append({"part": part, **record})
                jf.write(json.dumps(records[-1]) + "\n")
                jf.flush()
                print(f"  {part} {record['row']}: {record['status']} ({record['wall_s']:.0f} s)", flush=True)
    table = report(records)
    print(table)
    files["txt"].write_text(table + "\n", encoding="utf-8")
    print(f"in {out_dir}: " + ", ".join(sorted(p.name for p in out_dir.iterdir())))
    return 1 if any(r["status"] not in ("ok", "skipped") for r in records) else 0


def skipped(record: dict, error: str) -> dict:
    """A row that did not run, and why."""
    return {**record, "status": "skipped", "error": error, "wall_s": 0.0}


def budget_left(part_end: float, missing: str | None = None) -> tuple[float, str | None]:
    """The seconds left of the part's budget, and why a row must not start (None: it may): `missing` (what the row
    cannot import, from `cannot_import`), or too little time left."""
    left_s = part_end - time.monotonic()
    return left_s, missing or (f"budget: {left_s:.0f} s left" if left_s < MIN_ROW_S else None)


def cannot_import(modules: str, env: dict[str, str]) -> str | None:
    """Why `import modules` fails in the rows' environment (checked off the chip), or None when it imports."""
    check = subprocess.run([sys.executable, "-c", f"import {modules}"], capture_output=True, text=True,
                           env=dict(env, JAX_PLATFORMS="cpu"))
    return None if check.returncode == 0 else f"import {modules}: {error_line(check.stderr)}"


def run_tests(dry_run: bool, env: dict[str, str], part_end: float, log, out_dir: Path):
    """`pytest -m tpu` in one process (one program holds the chip); SYSTOLIC_TEST_PLATFORMS=tpu,cpu keeps
    tests/conftest.py from pinning JAX to the CPU. Collection errors (a test module importing what the machine
    lacks) do not stop the tests that were collected."""
    # Every `tpu` test lives in tests/tpu/ (collecting the whole suite there took a minute of the command's ten).
    where = os.environ.get("SYSTOLIC_TPU_SH_TESTS", "tests/tpu/")
    cmd = [sys.executable, "-m", "pytest", "-m", "tpu", "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", f"--junitxml={out_dir / 'pytest.xml'}", *shlex.split(where)]
    test_env = env if dry_run else dict(env, SYSTOLIC_TEST_PLATFORMS="tpu,cpu")
    row = {"row": f"pytest -m tpu {where}", "command": " ".join(cmd[1:])}
    left_s, why = budget_left(part_end)
    if why:
        yield skipped(row, why)
        return
    status, _, wall_s = run_command(cmd, test_env, left_s, log, "test")
    output = Path(log.name).read_text(encoding="utf-8").rpartition("=== test: ")[2]
    found = re.findall(r"^=* ?(\d+ (?:passed|failed|skipped|deselected|errors?)\b.*?) ?=*$", output, re.M)
    summary = found[-1] if found else "no summary line (see tpu-bench.log)"
    # A test module that imports what the machine lacks is a collection error ("ERROR tests/x.py"), which fails the
    # run but not a `tpu` test: such a run counts as ok, and says so.
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if status == "failed" and failures and all("::" not in f for f in failures):
        status, summary = "ok", f"{summary}; {len(failures)} test modules did not import (tpu-bench.log)"
    yield {**row, "status": status, "summary": summary, "error": summary, "wall_s": wall_s}


def run_train(dry_run: bool, env: dict[str, str], part_end: float, log, out_dir: Path):
    # Cold compiles are the figure: the rows do not read the persistent cache that the other parts use.
    bench_env = dict(env, SYSTOLIC_COMPILE_CACHE="off")
    for row in TRAIN_ROWS:
        yield run_bench_row(row, dry_run, bench_env, part_end - time.monotonic(), MIN_ROW_S, log, platform="tpu")


def serve_part(part: str, rows: tuple, dry_rows: tuple):
    """A part of SERVE_ENGINE rows (label, arguments): its levels into serve-engine.jsonl, its
    warm-up time from its output."""

    def run(dry_run: bool, env: dict[str, str], part_end: float, log, out_dir: Path):
        jsonl = out_dir / "serve-engine.jsonl"
        for label, args in dry_rows if dry_run else rows:
            cmd = [sys.executable, SERVE_ENGINE, *args, "--json", str(jsonl)]
            before = len(jsonl.read_text().splitlines()) if jsonl.exists() else 0
            record = {"row": label, "command": " ".join(cmd[1:])}
            left_s, why = budget_left(part_end)
            if why:
                yield skipped(record, why)
                continue
            status, out, wall_s = run_command(cmd, env, left_s, log, part)
            levels = [json.loads(line) for line in jsonl.read_text().splitlines()[before:]] if jsonl.exists() else []
            warmup = WARMUP.search(out)
            yield {**record, "status": status, "error": "" if status == "ok" else out, "levels": levels,
                   "warmup_s": float(warmup[1]) if warmup else None, "wall_s": wall_s}

    return run


def run_rl_vs_purejaxrl(dry_run: bool, env: dict[str, str], part_end: float, log, out_dir: Path):
    """Each RL_ROWS row: one RL_VS_PUREJAXRL pair; its summary (both sides' median env steps/s, final
    training return, compile and wall times, the ratio) into the row's record."""
    missing = cannot_import("gymnax, flax.linen, optax", env)
    for label, overrides, dry in RL_ROWS:
        with tempfile.TemporaryDirectory(prefix="tpu-bench-rl-") as tmp:
            summary_file = Path(tmp) / "summary.jsonl"
            cmd = [sys.executable, RL_VS_PUREJAXRL, "--pairs", "1", "--no-peak", "--platform",
                   "cpu" if dry_run else "tpu", "--json", str(summary_file), "--set", *overrides,
                   *(dry if dry_run else [])]
            record = {"row": label, "command": " ".join(cmd[1:])}
            left_s, why = budget_left(part_end, missing)
            if why:
                yield skipped(record, why)
                continue
            status, out, wall_s = run_command(cmd, env, left_s, log, "rl")
            summary = json.loads(summary_file.read_text()) if status == "ok" and summary_file.exists() else None
            if status == "ok" and summary is None:
                status, out = "failed", "no summary written (see tpu-bench.log)"
            yield {**record, **({"vs_purejaxrl": summary} if summary else {}), "status": status,
                   "error": "" if status == "ok" else out, "wall_s": wall_s}


def run_sim_benchmarks(dry_run: bool, env: dict[str, str], part_end: float, log, out_dir: Path):
    """Each SIM_BENCH_ROWS row: one benchmark script, its JSON objects (one per size) appended to sim.jsonl and
    copied into the row's record; then the CLI rows (`systolic simulate`) in what is left of the budget."""
    jsonl = out_dir / "sim.jsonl"
    no_jax_cfd = cannot_import("jax_cfd", env)
    for label, script, args, dry in SIM_BENCH_ROWS:
        cmd = [sys.executable, script, *(dry if dry_run else args), "--json", str(jsonl)]
        record = {"row": label, "command": " ".join(cmd[1:])}
        missing = no_jax_cfd and f"{no_jax_cfd} (benchmarks/harness/tpu-wheels.sh carries it)"
        left_s, why = budget_left(part_end, missing if script == SIM_VS_JAX_CFD else None)
        if why:
            yield skipped(record, why)
            continue
        before = len(jsonl.read_text().splitlines()) if jsonl.exists() else 0
        status, out, wall_s = run_command(cmd, env, left_s, log, "sim")
        results = [json.loads(line) for line in jsonl.read_text().splitlines()[before:]] if jsonl.exists() else []
        if status == "ok" and not results:
            status, out = "failed", "no JSON written (see tpu-bench.log)"
        elif status == "ok" and not dry_run and not all(r["device"].startswith("TPU") for r in results):
            status, out = "failed", f"ran on {results[0]['device']}, not the chip"
        yield {**record, "results": results, "status": status, "error": "" if status == "ok" else out,
               "wall_s": wall_s}
    yield from run_cli("sim", (("sim-turbulence float32 1024^2", ["simulate", *TURBULENCE], TURBULENCE_DRY),),
                       imports=None)(dry_run, env, part_end, log, out_dir)


def run_cli(part: str, rows: tuple, imports: str | None):
    """A part whose rows (label, argv, dry-run overrides) run the real CLI (`systolic simulate`, `systolic train
    gan`) and read its `throughput:` line (and the MFU on it, where there is one); skipped with the reason when
    `imports` (what the workload needs) does not import."""

    def run(dry_run: bool, env: dict[str, str], part_end: float, log, out_dir: Path):
        missing = cannot_import(imports, env) if imports else None
        for label, argv, dry in rows:
            with tempfile.TemporaryDirectory(prefix=f"tpu-bench-{part}-") as run_dir:
                cmd = [sys.executable, "-m", "systolic", *argv, *(dry if dry_run else []), "--run-dir", run_dir]
                record = {"row": label, "command": " ".join(cmd[1:])}
                left_s, why = budget_left(part_end, missing)
                if why:
                    yield skipped(record, why)
                    continue
                status, out, wall_s = run_command(cmd, env, left_s, log, part)
                found = THROUGHPUT.search(out) if status == "ok" else None
                measured = {"throughput": float(found[1].replace(",", "")), "unit": found[2],
                            "compile_s": float(found[3]), "run_wall_s": float(found[4])} if found else {}
                if found and (mfu := MFU.search(out)):
                    measured["mfu"] = float(mfu[1]) / 100
                yield {**record, **measured, "status": status, "error": "" if status == "ok" else out,
                       "wall_s": wall_s}

    return run


PART_RUNNERS = {"test": run_tests, "train": run_train, "serve": serve_part("serve", SERVE_ROWS, SERVE_DRY),
                "serve-int8": serve_part("serve-int8", SERVE_INT8_ROWS, SERVE_INT8_DRY),
                "serve-steps": serve_part("serve-steps", SERVE_STEPS_ROWS, SERVE_STEPS_DRY),
                "rl": run_rl_vs_purejaxrl,
                "sim": run_sim_benchmarks,
                "gan": run_cli("gan", (("gan-dcgan-64 (digits, 1 channel)", ["train", "gan", *GAN], GAN_DRY),),
                               imports="sklearn, PIL")}


def report(records: list[dict]) -> str:
    """The training rows' table, then one line per other row (and per serving level)."""
    lines = []
    train = [r for r in records if r["part"] == "train"]
    if train:
        lines.append(format_table(train))
    for r in records:
        if r["part"] == "train":
            continue
        head = f"{r['part']:<6} {r['row']}"
        if r["status"] != "ok":
            lines.append(f"{head}: {r['status'].upper()}: {r['error']}")
        elif r["part"] == "test":
            lines.append(f"{head}: {r['summary']}")
        elif r["part"] in ("serve", "serve-int8", "serve-steps"):
            warmup = "" if r.get("warmup_s") is None else f", warm-up {r['warmup_s']:.1f} s"
            lines.append(f"{head}: ok in {r['wall_s']:.0f} s{warmup}")
            lines += [f"  {x['in_flight']:>3} in flight: {x['tok_s']:,.0f} output tok/s, TTFT p50 {x['ttft_p50_ms']:.0f} "
                      f"ms, TPOT p50 {x['tpot_p50_ms']:.1f} ms" for x in r["levels"]]
        elif "vs_purejaxrl" in r:
            v = r["vs_purejaxrl"]
            lines.append(f"{head}: systolic {v['systolic']['env_steps_per_s']:,.0f} env steps/s (return "
                         f"{v['systolic']['final_return']:.1f}), PureJaxRL {v['purejaxrl']['env_steps_per_s']:,.0f} "
                         f"(return {v['purejaxrl']['final_return']:.1f}): {v['ratio']:.2f}x; compile "
                         f"{v['systolic']['compile_s']:.1f} / {v['purejaxrl']['compile_s']:.1f} s")
        elif "results" in r:
            lines += [f"{head}: {sim_line(x)}" for x in r["results"]]
        elif "throughput" in r:
            mfu = f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""
            lines.append(f"{head}: {r['throughput']:,.0f} {r['unit']}{mfu}, first (compile) {r['compile_s']:.1f} s, "
                         f"run {r['run_wall_s']:.1f} s")
        else:
            lines.append(f"{head}: ok, no throughput line (see tpu-bench.log)")
    return "\n".join(lines)


def sim_line(x: dict) -> str:
    """One size of SIM_VS_JAX_CFD or DNS3D_FFT_SHARE, as a line of the report."""
    if "jax_cfd_steps_per_s" in x:
        return (f"{x['n']}^2 x {x['steps']} steps: systolic {x['systolic_steps_per_s']:,.1f} steps/s, jax-cfd "
                f"{x['jax_cfd_steps_per_s']:,.1f}: {x['ratio']:.2f}x; energy / enstrophy rel. diff "
                f"{x['energy_rel_diff']:.1e} / {x['enstrophy_rel_diff']:.1e}, max vorticity {x['max_rel_diff']:.1e}")
    roofline = ("" if x["fft_of_roofline"] is None else
                f" (memory roofline {x['fft_roofline_ms_per_step']:.2f} ms: {x['fft_of_roofline']:.1%} of it)")
    return (f"{x['n']}^3 x {x['steps']} steps: {x['steps_per_s']:,.2f} steps/s ({x['step_ms']:.2f} ms), FFTs "
            f"{x['fft_ms_per_step']:.2f} ms = {x['fft_share']:.0%} of the step, {x['fft_gb_per_s']:.0f} GB/s{roofline}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
