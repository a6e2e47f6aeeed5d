"""Step time, tokens/s and MFU of gpt2-124m and llama-1b on one NVIDIA GPU in bfloat16, cuDNN against XLA
attention, and a scanned against a looped layer stack: the rows of `benchmarks/harness/gpu.sh`, which installs the
carried wheels and puts `src/` on PYTHONPATH before it runs this. Budget: under 8 minutes on one H200.

    bash benchmarks/harness/gpu.sh                            # on the GPU machine; the table, and JSON lines in $OUT
    SYSTOLIC_GPU_SH_DRY_RUN=1 bash benchmarks/harness/gpu.sh  # anywhere: the same rows shrunk to tiny models on CPU

Each row is one `systolic bench lm --recipe R --json` process (a fresh process per row: each gets the whole GPU,
and an out-of-memory row fails alone). Rows run in order until the time budget is spent; a row that would start
with too little time left is reported as skipped. MFU is against the data sheet's dense bf16 peak (989 TFLOP/s
for an H200; an 8192^3 bf16 matmul measured 770-800 TFLOP/s on the machines this was written for).

Exit codes: 0 every row that ran succeeded; 1 a row failed (see the table and $OUT/gpu-bench.log);
2 JAX sees no GPU (and no dry run was asked for).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench_rows import Row, format_table, preflight, run_bench_row  # sys.path[0]: benchmarks/harness/

DRY_RUN_ENV = "SYSTOLIC_GPU_SH_DRY_RUN"
BUDGET_ENV = "SYSTOLIC_GPU_SH_BUDGET_S"
BUDGET_S = 450.0  # of the 8 minutes; the rest is the wheels' install and start-up
MIN_ROW_S = 60.0  # a row never starts with less than this left: a llama-1b compile alone takes tens of seconds
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


PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "grain",
            "array-record", "tensorboardX", "numpy")


def main() -> int:
    dry_run = os.environ.get(DRY_RUN_ENV, "") not in ("", "0", "false")
    out_dir = Path(os.environ.get("OUT") or "/tmp/gpu-bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    budget_s = float(os.environ.get(BUDGET_ENV, BUDGET_S))
    start = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               SYSTOLIC_COMPILE_CACHE="off")  # cold compiles are the figure; a bare machine has no cache anyway
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # JAX's default takes 75% of the GPU's memory

    info = preflight(dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false"), PACKAGES,
                     "run benchmarks/harness/gpu-wheels.sh where a registry is reachable and carry .whl/; gpu.sh "
                     "installs it.")
    if info is None:
        return 1
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
            record = run_bench_row(row, dry_run, env, left_s, MIN_ROW_S, lf, platform="gpu")
            records.append(record)
            jf.write(json.dumps(record) + "\n")
            jf.flush()
            print(f"  {row.name}: {record['status']} ({record['wall_s']:.0f} s)", flush=True)
    table = format_table(records) + pairs(records)
    print(table)
    (out_dir / "gpu-bench.txt").write_text(table + "\n", encoding="utf-8")
    print(f"JSON lines: {jsonl}; the rows' output: {log}; total {time.monotonic() - start:.0f} s")
    return 1 if any(r["status"] not in ("ok", "skipped") for r in records) else 0


def pairs(records: list[dict]) -> str:
    """The comparisons: cuDNN against XLA attention, a scanned against a looped layer stack."""
    lines = []
    by_name = {r["row"]: r for r in records if r["status"] == "ok"}
    compared = (("llama-1b", "llama-1b xla-attn", lambda r: f"attention {r['attention']}"),
             ("gpt2-124m scan", "gpt2-124m", lambda r: "scan" if r["scan_layers"] else "loop"))
    for a, b, label in compared:
        if a in by_name and b in by_name:
            ra, rb = by_name[a], by_name[b]
            lines.append(f"{ra['recipe']} {label(ra)} vs {label(rb)}: step {ra['step_time_s'] * 1e3:.1f} vs "
                         f"{rb['step_time_s'] * 1e3:.1f} ms, compile + first step {ra['compile_s']:.1f} vs "
                         f"{rb['compile_s']:.1f} s")
    return "".join("\n" + line for line in lines)


if __name__ == "__main__":
    sys.exit(main())
