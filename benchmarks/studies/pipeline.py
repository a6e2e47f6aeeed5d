"""Pipeline parallelism on 8 fake CPU devices: the bubble against its formula, and throughput against pure data
parallel at the same global batch.

The model is a small Llama (d_model 64, 8 layers, 4 heads, float32, byte vocabulary, model.scan_layers=true),
32 sequences of 64 tokens per step; the real lm train step (build_step: loss, AdamW, guard) on random tokens.

1. Bubble. On data=2 x stage=4, GPipe with 1 to 16 microbatches and the circular schedule (2 repeats) with 4 to
   16. Every stage computes at every tick, also in the bubble (on whatever it holds: the result is dropped), so on
   fake devices that share the host's cores the bubble costs compute rather than idle time: the step time should
   follow t(M) = t_work (r M + S - 1) / (r M). The script fits t = a + b / M to the GPipe times (a = t_work, b / a
   should be S - 1 = 3) and reports each layout's measured bubble 1 - a / t against (S - 1) / (r M + S - 1).
2. Throughput at global batch 32: data=8 against pipelines of 2, 4 and 8 stages.

The layouts alternate within each round (drifts in the machine's speed hit them alike); each figure is the median
over the rounds of the median step time of `--steps` steps. The process starts as the CLI does
(`cpu_tuning.apply_at_start`).

    python benchmarks/studies/pipeline.py [--rounds 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from systolic.runtime import cpu_tuning  # noqa: E402

cpu_tuning.apply_at_start(workload="lm", stepping=True)  # before jax starts: the CLI's XLA:CPU flags

import jax  # noqa: E402
import numpy as np  # noqa: E402

from systolic import config as config_lib  # noqa: E402
from systolic.data.tokenizer import ByteTokenizer  # noqa: E402
from systolic.runtime import mesh as mesh_lib  # noqa: E402
from systolic.runtime.sharding import activate  # noqa: E402
from systolic.workloads.lm.config import LMConfig  # noqa: E402
from systolic.workloads.lm.parallel.pipeline import bubble_fraction  # noqa: E402
from systolic.workloads.lm.train import build_step  # noqa: E402

MODEL = ["model.d_model=64", "model.layers=8", "model.heads=4", "model.kv_heads=4", "model.max_seq_len=64",
         "model.dtype=float32", "model.scan_layers=true", "data.seq_len=64", "train.batch_size=32", "train.steps=100"]
STAGES = 4
BUBBLE = [({"data": 2, "stage": STAGES}, m, 1) for m in (1, 2, 4, 8, 16)] + [
    ({"data": 2, "stage": STAGES}, m, 2) for m in (4, 8, 16)]
THROUGHPUT = [({"data": 8}, 1, 1), ({"data": 4, "stage": 2}, 8, 1), ({"data": 2, "stage": 4}, 16, 1),
              ({"data": 2, "stage": 4}, 16, 2), ({"data": 1, "stage": 8}, 32, 1)]


def name(axes: dict[str, int], microbatches: int, repeats: int) -> str:
    mesh = ",".join(f"{a}={n}" for a, n in axes.items())
    return mesh if "stage" not in axes else f"{mesh} M={microbatches}" + (f" r={repeats}" if repeats > 1 else "")


def make_runner(axes: dict[str, int], microbatches: int, repeats: int):
    """A compiled train step on its mesh and a function that times `n` steps (median seconds)."""
    overrides = [*MODEL, *(f"mesh.{a}={n}" for a, n in axes.items())]
    if "stage" in axes:
        overrides += [f"pipeline.microbatches={microbatches}", f"pipeline.repeats={repeats}"]
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))
    mesh = mesh_lib.make_mesh(cfg.mesh)
    step = build_step(cfg, mesh, ByteTokenizer())  # random byte ids
    tokens = np.random.default_rng(0).integers(0, step.vocab, (cfg.train.batch_size, cfg.data.seq_len + 1), np.int32)
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, step.batch_sharding)
    with activate(mesh, step.rules):
        holder = {"state": step.init()}
        holder["state"], _ = step.train_step(holder["state"], batch)  # compile
        jax.block_until_ready(holder["state"])

    def time_steps(n: int) -> float:
        times = []
        with activate(mesh, step.rules):
            for _ in range(n):
                t = time.perf_counter()
                holder["state"], metrics = step.train_step(holder["state"], batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    return time_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    runners = {}  # by name: the two lists share layouts
    for axes, m, r in BUBBLE + THROUGHPUT:
        key = name(axes, m, r)
        if key not in runners:
            runners[key] = make_runner(axes, m, r)
            print(f"compiled {key}; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB",
                  file=sys.stderr, flush=True)
    times = {key: [] for key in runners}
    for i in range(args.rounds):
        for key, run in runners.items():
            times[key].append(run(args.steps))
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    step_s = {key: statistics.median(t) for key, t in times.items()}

    # 1. BUBBLE: fit t = a + b / M over the GPipe layouts.
    gpipe = [(m, step_s[name(axes, m, r)]) for axes, m, r in BUBBLE if r == 1]
    inv_m = np.array([1 / m for m, _ in gpipe])
    t = np.array([s for _, s in gpipe])
    b, a = np.polyfit(inv_m, t, 1)
    print(f"## Bubble on data=2 x stage={STAGES} ({args.rounds} rounds x {args.steps} steps, median)\n")
    print(f"fit over GPipe: t(M) = {a * 1e3:.1f} ms + {b * 1e3:.1f} ms / M; b / a = {b / a:.2f} "
          f"(formula: S - 1 = {STAGES - 1})\n")
    print("| layout | step (ms) | bubble measured 1 - a/t | formula (S-1)/(rM+S-1) |")
    print("|---|---:|---:|---:|")
    for axes, m, r in BUBBLE:
        s = step_s[name(axes, m, r)]
        print(f"| {name(axes, m, r)} | {s * 1e3:.1f} | {1 - a / s:.1%} | {bubble_fraction(STAGES, m, r):.1%} |")

    # 2. THROUGHPUT against data parallel at the same global batch.
    tokens = 32 * 64
    base = step_s[name(*THROUGHPUT[0])]
    print("\n## Throughput at global batch 32 x 64 tokens\n")
    print("| layout | step (ms) | tokens/s | vs data=8 | bubble (formula) |")
    print("|---|---:|---:|---:|---:|")
    for axes, m, r in THROUGHPUT:
        s = step_s[name(axes, m, r)]
        bubble = bubble_fraction(axes.get("stage", 1), m, r)
        print(f"| {name(axes, m, r)} | {s * 1e3:.1f} | {tokens / s:,.0f} | {base / s:.2f}x | {bubble:.1%} |")


if __name__ == "__main__":
    main()
