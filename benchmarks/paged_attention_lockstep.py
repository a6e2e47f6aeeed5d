"""The Pallas paged attention kernel with its tokens in lockstep (kernels/paged_attention.py's TOKENS_AT_ONCE) at each
given count, over three pools of the same step: bfloat16 in pages of 16 (the engine's) and of 128, and int8 in pages
of 128 (`--kv-cache int8`'s on a TPU); each cell is ms a step (every layer, as benchmarks/paged_attention.py builds
the step) and, in brackets, the largest difference from the plain-JAX path over the same pool. The variants alternate
round by round.

    PYTHONPATH=src python benchmarks/paged_attention_lockstep.py                          # on a TPU
    PYTHONPATH=src python benchmarks/paged_attention_lockstep.py llama-1b:64:1024 1,2,4,8 3
    PYTHONPATH=src python benchmarks/paged_attention_lockstep.py tiny:3:300 1,4 1          # off one: the interpreter

Arguments: rows (shape:sequences:positions, comma-separated), token counts, rounds.
"""

from __future__ import annotations

import sys

import bench_rows  # sys.path[0]: benchmarks/
import paged_attention as bench


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rows = argv[0].split(",") if argv else ["llama-1b:256:256", "llama-1b:64:1024"]
    counts = [int(k) for k in argv[1].split(",")] if len(argv) > 1 else [1, 2, 4, 8]
    rounds = int(argv[2]) if len(argv) > 2 else 3
    import jax
    import numpy as np

    from systolic.kernels import paged_attention as kernel_lib

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    for row in rows:
        shape, seqs, positions = row.split(":")
        pools, plains, kernels = {}, {}, {}
        for name, page in (("bf16 p16", 16), ("bf16 p128", 128)):
            pools[name], plains[name], kernels[name], _ = bench.make_step(shape, int(seqs), int(positions), 1,
                                                                         page=page)
        q, k, v, pool = pools["bf16 p128"]
        pools["int8 p128"] = (q, k, v, bench.quantized(pool, bench.SHAPES[shape][3]))
        plains["int8 p128"], kernels["int8 p128"] = plains["bf16 p128"], kernels["bf16 p128"]
        ref = {name: np.asarray(jax.jit(plains[name].__wrapped__)(*ops), np.float32) for name, ops in pools.items()}
        fns, diffs, original = {}, {}, kernel_lib.TOKENS_AT_ONCE
        try:
            for count in counts:
                kernel_lib.TOKENS_AT_ONCE = count  # read when the kernel is traced, just below
                for name, ops in pools.items():
                    f = jax.jit(kernels[name].__wrapped__)
                    out = np.asarray(jax.block_until_ready(f(*ops)), np.float32)
                    diffs[(name, count)] = float(np.max(np.abs(out - ref[name])))
                    fns[(name, count)] = (lambda f=f, ops=ops: f(*ops))
        finally:
            kernel_lib.TOKENS_AT_ONCE = original
        medians = bench_rows.alternating_medians(fns, (), rounds, 10)
        lines = [f"| {row} | " + " | ".join(f"{c} at once" for c in counts) + " |", "|---|" + "---:|" * len(counts)]
        for name in pools:
            lines.append(f"| {name} | " + " | ".join(f"{medians[(name, c)] * 1e3:.3f} ({diffs[(name, c)]:.3f})"
                                                     for c in counts) + " |")
        print("ms a step, every layer (max diff from the plain path):\n" + "\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
