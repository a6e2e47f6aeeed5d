"""Where an lm train step's time goes on the chip: a profile of a few steps, and its per-operation table.

    bash benchmarks/harness/tpu.sh env python3 benchmarks/harness/tpu_profile.py --recipe llama-1b \
        model.layers=8 model.remat=dots                     # on the chip: $OUT/<name>.xplane.pb
    python benchmarks/harness/tpu_profile.py --summarize FILE.xplane.pb [--top 30]    # here: pip install xprof

Its `traced` and `summarize` are the other chip scripts' too (peers/rl_profile.py, peers/sim_vs_jax_cfd.py --trace;
studies/serve_engine.py --profile writes a file this reads).

The first form compiles the real train step (as `systolic bench` does), prints its memory analysis, times 6 steps
dispatched back to back, then traces 2 more with `jax.profiler.trace`; the xplane file (a few MB; gpt2-124m at
32 x 1024: 10 MB for 2 steps) comes back through $OUT. The second reads it with xprof's `hlo_stats` tool and prints
self time by HLO category (convolution fusion: matmuls; custom-call: Pallas kernels such as splash attention; loop
fusion: elementwise work) and the slowest operations: how the TPU rows of docs/benchmarks.md were read
(2026-12-06: splash 20-28% of the lm steps, RoPE's float32 slices 9%, the guard's parameter scan 4%).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def profile(recipe: str, overrides: list[str], name: str, steps: int) -> int:
    import jax

    from systolic import config as config_lib
    from systolic.engine import fit
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.entry import build_bench_task

    out = Path(os.environ.get("OUT") or "/tmp/tpu-profile")
    out.mkdir(parents=True, exist_ok=True)
    cfg, _ = config_lib.load(LMConfig, recipe, overrides, "lm-tiny", "lm")
    with build_bench_task(cfg) as task:
        state = task.init_state()
        memory = fit.compile_step(task.train_step, state, next(task.data), advice="see `systolic plan --search`")
        if memory is not None:
            print(f"{name}: arguments {memory.argument_bytes / 2**30:.2f} GiB, temporaries "
                  f"{memory.temp_bytes / 2**30:.2f} GiB")
        for _ in range(3):  # the first call (compiled above) and two warm-up steps
            state, _ = task.train_step(state, next(task.data))
        batches = [next(task.data) for _ in range(6)]
        jax.block_until_ready(state)
        start = time.perf_counter()
        for batch in batches:
            state, _ = task.train_step(state, batch)
        jax.block_until_ready(state)
        step_s = (time.perf_counter() - start) / len(batches)
        mfu = f", MFU {100 * task.flops_per_step / step_s / task.peak_flops:.1f}%" if task.peak_flops else ""
        print(f"{name}: {step_s * 1e3:.1f} ms a step{mfu}")
        holder = [state]

        def run_steps():
            for _ in range(steps):
                holder[0], _ = task.train_step(holder[0], next(task.data))
            return holder[0]

        traced(name, run_steps, out)
    return 0


def traced(name: str, run, out: Path) -> None:
    """Runs `run()` (to its results being ready) under jax.profiler.trace and copies the xplane file to
    out/<name>.xplane.pb."""
    import jax

    trace_dir = tempfile.mkdtemp(prefix="tpu-profile-")
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(run())
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        shutil.copy(path, out / f"{name}.xplane.pb")  # flat: the device tool brings back two folders down at most
        print(f"{name}: traced into {out / f'{name}.xplane.pb'}")


def summarize(path: str, top: int) -> int:
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError:
        print("tpu_profile: reading a profile needs xprof (pip install xprof), which is not installed.",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:  # xprof caches its result by folder: one of its own
        copy = Path(folder) / Path(path).name
        shutil.copy(path, copy)
        data, _ = raw_to_tool_data.xspace_to_tool_data([str(copy)], "hlo_stats", {})
    table = json.loads(data)
    columns = [c["id"] for c in table["cols"]]
    ops = [dict(zip(columns, [cell.get("v") for cell in row["c"]])) for row in table["rows"]]
    total = sum(op["total_self_time"] for op in ops)
    by_category = collections.Counter()
    for op in ops:
        by_category[op["category"]] += op["total_self_time"]
    print(f"{path}: {total / 1e3:.1f} ms of device time traced")
    for category, us in by_category.most_common():
        print(f"  {category:<28} {us / 1e3:9.1f} ms {100 * us / total:5.1f}%")
    print(f"the {top} slowest operations (self time, occurrences, rate):")
    for op in sorted(ops, key=lambda op: -op["total_self_time"])[:top]:
        print(f"  {op['total_self_time'] / 1e3:8.2f} ms {op['occurrences']:>4.0f}x {op['category'][:20]:<20} "
              f"{op['hlo_op_name'][:44]:<44} {op.get('model_flop_rate') or 0:9.0f} GFLOP/s "
              f"{op.get('measured_memory_bw') or 0:6.0f} GB/s")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--recipe", default="llama-1b")
    parser.add_argument("--name", help="the profile's file name (default: from the recipe)")
    parser.add_argument("--steps", type=int, default=2, help="steps to trace")
    parser.add_argument("--summarize", metavar="XPLANE", help="print the per-operation table of a traced profile")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize, args.top)
    from systolic.errors import UserError

    try:
        return profile(args.recipe, args.overrides, args.name or args.recipe, args.steps)
    except UserError as e:  # a config the CLI would refuse: its paragraph, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
