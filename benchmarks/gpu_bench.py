"""Step time, tokens/s and MFU of gpt2-124m and llama-1b on one NVIDIA GPU in bfloat16, cuDNN against XLA
attention, and a scanned against a looped layer stack: the rows of `benchmarks/gpu.sh`, which installs the
carried wheels and puts `src/` on PYTHONPATH before it runs this. Budget: under 8 minutes on one H200.

    bash benchmarks/gpu.sh                               # on the GPU machine; the table, and JSON lines in $OUT
    SYSTOLIC_GPU_SH_DRY_RUN=1 bash benchmarks/gpu.sh     # anywhere: the same rows shrunk to tiny models on CPU

Each row is one `systolic bench lm --recipe R --json` process (a fresh process per row: each gets the whole GPU,
and an out-of-memory row fails alone). Rows run in order until the time budget is spent; a row that would start
with too little time left is reported as skipped. MFU is against the data sheet's dense bf16 peak (989 TFLOP/s
for an H200; an 8192^3 bf16 matmul measured 770-800 TFLOP/s on the machines this was written for).

Exit codes: 0 every row that ran succeeded; 1 a row failed (see the table and $OUT/gpu-bench.log);
2 JAX sees no GPU (and no dry run was asked for).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DRY_RUN_ENV = "SYSTOLIC_GPU_SH_DRY_RUN"
BUDGET_ENV = "SYSTOLIC_GPU_SH_BUDGET_S"
BUDGET_S = 450.0  # of the 8 minutes; the rest is the wheels' install and start-up
MIN_ROW_S = 60.0  # a row never starts with less than this left: a llama-1b compile alone takes tens of seconds
# Enough text for the bench's batches (the default corpus: the standard library's .py files), read in seconds.
DATA = ["data.max_bytes=20000000"]


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    recipe: str
    batch_size: int
    seq_len: int  # the recipe's data.seq_len
    steps: int
    attention: str  # model.attention
    timeout_s: float
    scan_layers: bool  # model.scan_layers (the recipes: gpt2-124m loops, llama-1b scans)

    def attention_run(self, dry_run: bool) -> str:
        """model.attention as run: a dry run on CPU takes XLA's formulation where the GPU takes cuDNN's."""
        return "xla" if dry_run and self.attention == "cudnn" else self.attention

    def overrides(self, dry_run: bool) -> list[str]:
        out = [f"train.batch_size={self.batch_size}", f"model.attention={self.attention_run(dry_run)}",
               f"model.scan_layers={str(self.scan_layers).lower()}", *DATA]
        return out + (tiny(self.recipe) if dry_run else [])


# Batch sizes for a 141 GB H200 (XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 below), checked with `systolic plan lm
# --target h200` (XLA:CPU standing in for the GPU, so an estimate; it plans XLA attention, which holds (B, H, T, T)
# scores where cuDNN does not), jax 0.11.2, 2026-12-04:
# - gpt2-124m, 32 x 1024 (the recipe's): at 64 x 1024 with XLA attention the plan says 171 GiB, does not fit; about
#   100 GiB of that is the 12 layers' saved scores, so cuDNN at 64 x 1024 would fit by the estimate (~70 GiB),
#   but that figure is another compiler's: the first run keeps the recipe's batch. Try 64 once this has run.
# - llama-1b, 16 x 2048 (recipe: remat=dots, scan_layers): 66.8 GiB peak with XLA attention, so the XLA row fits
#   and both attention rows use the same batch.
ROWS = (
    Row("gpt2-124m", "gpt2-124m", batch_size=32, seq_len=1024, steps=20, attention="cudnn", scan_layers=False,
        timeout_s=150),
    Row("llama-1b", "llama-1b", batch_size=16, seq_len=2048, steps=10, attention="cudnn", scan_layers=True,
        timeout_s=200),
    # The README's open question: is lax.scan over the layers (compiled once) slower per step on a GPU?
    Row("gpt2-124m scan", "gpt2-124m", batch_size=32, seq_len=1024, steps=20, attention="cudnn", scan_layers=True,
        timeout_s=120),
    Row("llama-1b xla-attn", "llama-1b", batch_size=16, seq_len=2048, steps=10, attention="xla", scan_layers=True,
        timeout_s=200),
)


TINY_BATCH, TINY_SEQ = 4, 64


def tiny(recipe: str) -> list[str]:
    """The dry run's overrides: the recipe's family at 2 layers of width 64, sequences of 64 tokens, in bfloat16
    (as on a GPU; `auto` would be float32 on CPU)."""
    shrink = ["model.dtype=bfloat16", "model.d_model=64", "model.layers=2", "model.heads=4",
              f"model.max_seq_len={TINY_SEQ}", "model.vocab_size=320", f"data.seq_len={TINY_SEQ}",
              f"train.batch_size={TINY_BATCH}", "data.max_bytes=300000", "data.val_percent=30"]
    return shrink + (["model.kv_heads=2", "model.mlp_dim=128"] if recipe.startswith("llama") else [])


# Run in a child process so that this one never starts a JAX backend: on a GPU that would take (preallocate) the
# memory the benchmark rows need.
PREFLIGHT = r"""
import json, sys
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
info = {"python": sys.version.split()[0],
        "packages": {n: version(n) for n in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax",
                                             "optax", "orbax-checkpoint", "grain", "array-record", "tensorboardX",
                                             "numpy")}}
import jax, grain, systolic
info.update(backend=jax.default_backend(), devices=[d.device_kind for d in jax.devices()],
            systolic=systolic.__file__)
print(json.dumps(info))
"""


def main() -> int:
    dry_run = os.environ.get(DRY_RUN_ENV, "") not in ("", "0", "false")
    out_dir = Path(os.environ.get("OUT") or "/tmp/gpu-bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    budget_s = float(os.environ.get(BUDGET_ENV, BUDGET_S))
    start = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               SYSTOLIC_COMPILE_CACHE="off")  # cold compiles are the figure; a bare machine has no cache anyway
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # JAX's default takes 75% of the GPU's memory

    try:
        pre = subprocess.run([sys.executable, "-c", PREFLIGHT], capture_output=True, text=True, env=dict(
            env, XLA_PYTHON_CLIENT_PREALLOCATE="false"), timeout=120)
    except subprocess.TimeoutExpired:
        print("gpu_bench: the preflight (import jax, list the devices) took over 120 s; the GPU or its driver does "
              "not answer. Fix: check nvidia-smi on that machine.", file=sys.stderr)
        return 1
    if pre.returncode != 0:
        print(f"gpu_bench: the preflight (import jax, grain and systolic) failed:\n{pre.stderr[-3000:]}\nFix: run "
              "benchmarks/gpu-wheels.sh where a registry is reachable and carry .whl/; gpu.sh installs it.",
              file=sys.stderr)
        return 1
    info = json.loads(pre.stdout.strip().splitlines()[-1])
    print(f"python {info['python']}; " + ", ".join(f"{k} {v}" for k, v in info["packages"].items() if v))
    print(f"backend {info['backend']}: {len(info['devices'])} x {info['devices'][0]}; systolic from {info['systolic']}")
    if info["backend"] != "gpu" and not dry_run:
        print(f"gpu_bench: JAX sees no GPU (backend {info['backend']!r}, devices {info['devices']}). Fix: run it on "
              "the NVIDIA machine, whose image has jax with its CUDA plugin (jax-cuda13-plugin); or set "
              f"{DRY_RUN_ENV}=1 to check the wiring on CPU with tiny models.", file=sys.stderr)
        return 2
    if dry_run:
        print(f"{DRY_RUN_ENV}: tiny bfloat16 models on {info['backend']}, 2 timed steps, XLA attention where the "
              "GPU rows use cuDNN; the figures mean nothing")

    jsonl, log = out_dir / "gpu-bench.jsonl", out_dir / "gpu-bench.log"
    records = []
    with open(jsonl, "w", encoding="utf-8") as jf, open(log, "w", encoding="utf-8") as lf:
        jf.write(json.dumps({"kind": "env", "dry_run": dry_run, **info}) + "\n")
        for row in ROWS:
            left_s = budget_s - (time.monotonic() - start)
            record = run_row(row, dry_run, env, left_s, lf)
            records.append(record)
            jf.write(json.dumps(record) + "\n")
            jf.flush()
            print(f"  {row.name}: {record['status']} ({record['wall_s']:.0f} s)", flush=True)
    table = format_table(records)
    print(table)
    (out_dir / "gpu-bench.txt").write_text(table + "\n", encoding="utf-8")
    print(f"JSON lines: {jsonl}; the rows' output: {log}; total {time.monotonic() - start:.0f} s")
    return 1 if any(r["status"] not in ("ok", "skipped") for r in records) else 0


def run_row(row: Row, dry_run: bool, env: dict[str, str], left_s: float, log) -> dict:
    overrides = row.overrides(dry_run)
    cmd = [sys.executable, "-m", "systolic", "bench", "lm", "--recipe", row.recipe, "--json",
           "--steps", str(2 if dry_run else row.steps), *overrides]
    batch, seq = (TINY_BATCH, TINY_SEQ) if dry_run else (row.batch_size, row.seq_len)
    record = {"kind": "row", "row": row.name, "recipe": row.recipe, "attention": row.attention_run(dry_run),
              "scan_layers": row.scan_layers, "batch_size": batch, "seq_len": seq, "overrides": overrides,
              "command": " ".join(cmd[1:])}
    if left_s < MIN_ROW_S:
        return {**record, "status": "skipped", "error": f"{left_s:.0f} s of the budget left", "wall_s": 0.0}
    timeout_s = min(row.timeout_s, left_s)
    log.write(f"=== {row.name}: {' '.join(cmd[1:])}\n")
    log.flush()
    t = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        log.write(_text(e.stdout) + _text(e.stderr) + f"\n=== timed out after {timeout_s:.0f} s\n")
        return {**record, "status": "timeout", "error": f"over {timeout_s:.0f} s", "wall_s": time.monotonic() - t}
    wall_s = time.monotonic() - t
    log.write(proc.stdout + proc.stderr + f"\n=== exit {proc.returncode} after {wall_s:.0f} s\n")
    log.flush()
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        return {**record, "status": "failed", "error": _error_line(proc.stderr), "wall_s": wall_s}
    result = json.loads(lines[-1])
    if result["platform"] != "gpu" and not dry_run:  # e.g. the CLI found no /dev/nvidia* and chose the CPU
        return {**record, **result, "status": "failed", "error": f"ran on {result['platform']}", "wall_s": wall_s}
    return {**record, **result, "status": "ok", "wall_s": wall_s}


def _text(stream: bytes | str | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def _error_line(stderr: str) -> str:
    """The line that says what went wrong: an out-of-memory first, else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if "RESOURCE_EXHAUSTED" in line or "Out of memory" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def format_table(records: list[dict]) -> str:
    head = (f"{'row':<18} {'attention':<9} {'layers':<6} {'batch x seq':>11} {'compile s':>9} {'step ms':>9} "
            f"{'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8}")
    lines = [head, "-" * len(head)]
    for r in records:
        layers = "scan" if r["scan_layers"] else "loop"
        shape = f"{r['batch_size']} x {r['seq_len']}"
        prefix = f"{r['row']:<18} {r['attention']:<9} {layers:<6} {shape:>11}"
        if r["status"] != "ok":
            lines.append(f"{prefix} {r['status'].upper()}: {r['error']}")
            continue
        gib = f"{r['peak_memory_bytes'] / 2**30:8.1f}" if r["peak_memory_bytes"] else f"{'n/a':>8}"
        tflops = f"{r['flops_per_s'] / 1e12:8.1f}" if r["flops_per_s"] else f"{'n/a':>8}"
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] else f"{'n/a':>6}"
        lines.append(f"{prefix} {r['compile_s']:9.1f} {r['step_time_s'] * 1e3:9.1f} {r['items_per_s']:10,.0f} "
                     f"{tflops} {mfu} {gib}")
    by_name = {r["row"]: r for r in records if r["status"] == "ok"}
    pairs = (("llama-1b", "llama-1b xla-attn", lambda r: f"attention {r['attention']}"),
             ("gpt2-124m scan", "gpt2-124m", lambda r: "scan" if r["scan_layers"] else "loop"))
    for a, b, label in pairs:
        if a in by_name and b in by_name:
            ra, rb = by_name[a], by_name[b]
            lines.append(f"{ra['recipe']} {label(ra)} vs {label(rb)}: step {ra['step_time_s'] * 1e3:.1f} vs "
                         f"{rb['step_time_s'] * 1e3:.1f} ms, compile + first step {ra['compile_s']:.1f} vs "
                         f"{rb['compile_s']:.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
