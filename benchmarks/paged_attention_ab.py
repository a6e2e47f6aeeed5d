"""Two versions of the Pallas paged attention kernel on the same steps, side by side: a kernel module's file (e.g.
an earlier commit's, `git show REV:src/systolic/kernels/paged_attention.py > /tmp/before.py`) against this tree's
src/systolic/kernels/paged_attention.py, the sides alternating round by round, each step as
benchmarks/paged_attention.py builds it (every layer's attention of a decode batch, pages shuffled), and each
side's largest difference from the plain-JAX path.

    git show 8108e2b:src/systolic/kernels/paged_attention.py > /tmp/before.py
    PYTHONPATH=src python benchmarks/paged_attention_ab.py /tmp/before.py                    # on a TPU
    PYTHONPATH=src python benchmarks/paged_attention_ab.py /tmp/before.py --rows llama-1b:256:256@64

A row is shape:sequences:positions[:chunk][@page_size] (default page size 16). Off a TPU the kernels run in
Pallas's interpreter (a dry run: tiny rows only).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import bench_rows  # sys.path[0]: benchmarks/
import paged_attention as bench  # benchmarks/paged_attention.py: the step and its rows

ROWS = ("llama-1b:256:256", "llama-1b:256:256@64", "llama-1b:256:256@128", "llama-1b:64:256", "llama-1b:64:1024",
        "gemma3-1b:64:256", "gemma-2b:256:256", "gemma-2b:256:256@64")


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", help="a kernel module's file (the 'before' side)")
    p.add_argument("--rows", default=",".join(ROWS), help="shape:sequences:positions[:chunk][@page], comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per row (default 5)")
    p.add_argument("--reps", type=int, default=10, help="steps timed per round and side (default 10)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    import jax
    import numpy as np

    from systolic.workloads.lm.serve import paged_attention as pa

    spec = importlib.util.spec_from_file_location("kernel_before", args.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    sides = {"before": before.paged_attention, "after": pa.kernel_lib.paged_attention}
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; before: {args.before}")
    lines = ["| row | before ms | after ms | speed-up | after GB/s | max abs diff before / after |",
             "|---|---:|---:|---:|---:|---|"]
    after_kernel = pa.kernel_lib.paged_attention
    for row in args.rows.split(","):
        shape_part, _, page = row.partition("@")
        shape, seqs, positions, *chunk = shape_part.split(":")
        sizes = (shape, int(seqs), int(positions), int(chunk[0]) if chunk else 1)
        page_size = int(page) if page else bench.PAGE
        operands, plain, _, read = bench.make_step(*sizes, page=page_size)
        ref = np.asarray(jax.block_until_ready(plain(*operands)), np.float32)
        fns, diffs = {}, {}
        for name, kernel in sides.items():
            f = bench.make_step(*sizes, page=page_size)[2]  # its own jitted function, traced with this kernel
            pa.kernel_lib.paged_attention = kernel
            try:
                out = np.asarray(jax.block_until_ready(f(*operands)), np.float32)
            finally:
                pa.kernel_lib.paged_attention = after_kernel
            fns[name], diffs[name] = f, float(np.max(np.abs(out - ref)))
        medians = bench_rows.alternating_medians(fns, operands, args.rounds, args.reps)
        b, a = medians["before"], medians["after"]
        lines.append(f"| {row} | {b * 1e3:.3f} | {a * 1e3:.3f} | {b / a:.2f}x | {read / a / 1e9:.0f} | "
                     f"{diffs['before']:.4f} / {diffs['after']:.4f} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
