"""The Pallas paged attention kernel as the TPU compiler schedules it, no chip needed: each row is compiled for a v5e
here (libtpu's compile-only devices, `systolic plan`'s compiler), with the compiler's LLO dump on, and the table gives
the VLIW bundles of the kernel's innermost loop (one block of keys of one token),
the length of its critical path (cycles, the compiler's own estimate) and its busiest operations. A bundle issues in
one cycle when nothing stalls (DMA waits, bank conflicts), so the loop's bundles a block are a floor on its time on
the chip: on the v5e (~1.5 GHz) 1,000 bundles are 0.67 us, 4,096 blocks (llama-1b's 16 layers x 256 sequences) 2.7 ms.

    PYTHONPATH=src python benchmarks/kernels/kernel_bundles.py                          # llama-1b : 256 : 256
    PYTHONPATH=src python benchmarks/kernels/kernel_bundles.py --rows llama-1b:64:1024 --pools "int8 p128"

Rows are paged_attention.py's beside this file (shape:sequences:positions); pools: bfloat16 in pages of 16 and 128,
int8 in pages of 128 (`--kv-cache int8`'s). Each variant compiles in a process of its own (libtpu reads its dump flags
once), ~30 s each. Needs libtpu (`pip install jax[tpu]`).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

POOLS = {"bf16 p16": (16, False), "bf16 p128": (128, False), "int8 p128": (128, True)}


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="llama-1b:256:256", help="shape:sequences:positions, comma-separated")
    p.add_argument("--pools", default=",".join(POOLS), help=f"comma-separated, of: {', '.join(POOLS)}")
    p.add_argument("--compile", nargs=3, metavar=("ROW", "POOL", "DUMP"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def compile_one(row: str, pool: str, dump: str) -> None:
    """In a child process: the kernel over every layer of the row's decode step, compiled for a v5e, dumped."""
    os.environ["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true"
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cached program is not compiled, so not dumped
    import jax
    import numpy as np

    import paged_attention as bench  # sys.path[0]: benchmarks/kernels/paged_attention.py, the step and its rows
    from systolic.plan import targets
    from systolic.plan.planner import compile_lowered, devices_for, for_target

    target = targets.resolve("v5e-1", mesh_devices=1)
    shape, seqs, positions = row.split(":")
    page, int8 = POOLS[pool]
    operands, _, kernel, _ = bench.make_step(shape, int(seqs), int(positions), 1, page=page)
    if int8:
        operands = (*operands[:3], bench.quantized(operands[3], bench.SHAPES[shape][3]))
    with for_target(target):
        device = devices_for(target)[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), operands)
        # The kernel compiles (not its interpreter) for the platform of the mesh the step is traced under.
        with jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("x",))):
            lowered = jax.jit(kernel.__wrapped__).trace(*specs).lower(lowering_platforms=("tpu",))
        compiled, error = compile_lowered(lowered, target)
    if compiled is None:
        raise SystemExit(f"{row} {pool}: {error}")


def innermost(dump: Path) -> dict:
    """The kernel's innermost loop from the dump: bundles and operations a block, and its critical path."""
    from systolic.kernels.paged_attention.kernel import NAME  # the pallas_call's name, the dump files'

    bundles = next(p for p in dump.iterdir() if re.search(rf"{NAME}.*-final_bundles\.txt$", p.name)
                   and "schedule" not in p.name)
    lines = [line for line in bundles.read_text().splitlines() if re.match(r"\s*0x[0-9a-f]+", line)]
    depth = [len(re.match(r"\s*0x[0-9a-f]+\s+(?:\w\w)?:?\s*(>*)", line).group(1)) for line in lines]
    body = [line for line, d in zip(lines, depth) if d == max(depth)]
    ops = collections.Counter(op.split(".")[0] for line in body for op in re.findall(r"= (v[a-z]\w*|dma[\w.]*)", line))
    path = next(p for p in dump.iterdir() if re.search(rf"{NAME}.*-critical-path\.txt$", p.name))
    longest = max((int(n) for n in re.findall(r"Length to end: (\d+),", path.read_text())), default=0)
    return {"bundles": len(body), "critical": longest, "ops": dict(ops.most_common(6))}


def main(argv=None) -> int:
    args = _args(argv)
    if args.compile:
        compile_one(*args.compile)
        return 0
    lines = ["| row | pool | bundles a block | critical path (cycles) | most frequent operations a block |",
             "|---|---|---:|---:|---|"]
    for row in args.rows.split(","):
        for pool in args.pools.split(","):
            with tempfile.TemporaryDirectory() as dump:
                child = subprocess.run([sys.executable, __file__, "--compile", row, pool, dump],
                                       capture_output=True, text=True)
                if child.returncode:
                    print(child.stderr[-2000:], file=sys.stderr)
                    return 1
                r = innermost(Path(dump))
            ops = ", ".join(f"{k} {v}" for k, v in r["ops"].items())
            lines.append(f"| {row} | {pool} | {r['bundles']} | {r['critical']} | {ops} |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
