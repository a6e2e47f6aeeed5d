"""Minimal reproducer: XLA:CPU duplicates the residual-gradient chain into every fusion (work grows with depth^2).

A stack of pre-norm residual blocks, each `x + tanh(layernorm(x) @ W)`, nothing else. For each depth it compiles
the gradient and prints the largest fusion (instructions in one fused computation), the total instructions in
all fusions, and the measured time of one gradient, with and without `gradient_barrier` (systolic's identity
whose backward XLA cannot see through) on the residual stream. It also writes the unoptimised HLO of the
deepest plain case, the file to attach to an upstream report (`--hlo-out`).

    python benchmarks/studies/xla_cpu_fusion_repro.py                 # depths 2, 4, 8, 16 at width 256
    python benchmarks/studies/xla_cpu_fusion_repro.py --hlo-out docs/xla-cpu-fusion-repro.hlo
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import jax
import jax.numpy as jnp

from systolic.runtime import cpu_tuning
from systolic.workloads.lm.model.cpu import gradient_barrier


def layernorm(x: jax.Array) -> jax.Array:
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5)


def make_loss(depth: int, barrier: bool):
    def loss(ws: jax.Array, x: jax.Array) -> jax.Array:  # ws (L, D, D), x (N, D)
        for i in range(depth):
            if barrier:
                x = gradient_barrier(x)
            x = x + jnp.tanh(layernorm(x) @ ws[i])  # (N, D)
        return (layernorm(x) ** 2).mean()

    return jax.jit(jax.grad(loss))


def fusion_sizes(hlo: str) -> list[int]:
    """Instructions in each fused computation of an optimised HLO module's text."""
    sizes, current = [], None
    for line in hlo.splitlines():
        if re.match(r"^%?\S*fused\S* .*\{\s*$", line) or re.match(r"^%?fused_computation\S*", line):
            current = 0
        elif current is not None and line.startswith("}"):
            sizes.append(current)
            current = None
        elif current is not None and "=" in line:
            current += 1
    return sizes


def measure(depth: int, width: int, rows: int, barrier: bool, repeats: int = 5) -> tuple[int, int, float, str]:
    ws = jax.random.normal(jax.random.PRNGKey(0), (depth, width, width)) / width**0.5
    x = jax.random.normal(jax.random.PRNGKey(1), (rows, width))
    grad = make_loss(depth, barrier)
    lowered = grad.lower(ws, x)
    compiled = lowered.compile()
    sizes = fusion_sizes(compiled.as_text())
    compiled(ws, x).block_until_ready()
    t = time.perf_counter()
    for _ in range(repeats):
        compiled(ws, x).block_until_ready()
    seconds = (time.perf_counter() - t) / repeats
    return max(sizes, default=0), sum(sizes), seconds, lowered.as_text(dialect="hlo")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="2,4,8,16")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--hlo-out", help="write the unoptimised HLO of the deepest plain case here")
    a = p.parse_args(argv)
    depths = [int(d) for d in a.depths.split(",")]
    # systolic's XLA:CPU flags, as its training runs compile; before jax creates its backend (the print below).
    cpu_tuning.apply_at_start(workload="lm", stepping=False)
    print(f"jax {jax.__version__}, {jax.default_backend()}; x ({a.rows}, {a.width}); one gradient of the stack")
    print(f"{'depth':>5} {'barrier':>8} {'largest fusion':>15} {'all fusions':>12} {'grad ms':>9} {'ms/layer':>9}")
    hlo = ""
    for depth in depths:
        for barrier in (False, True):
            largest, total, seconds, text = measure(depth, a.width, a.rows, barrier)
            if not barrier:
                hlo = text
            print(f"{depth:>5} {str(barrier):>8} {largest:>15} {total:>12} {seconds * 1e3:>9.1f} "
                  f"{seconds * 1e3 / depth:>9.2f}")
    if a.hlo_out:
        with open(a.hlo_out, "w") as f:
            f.write(hlo)
        print(f"wrote the unoptimised HLO of depth {depths[-1]} without the barrier to {a.hlo_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
