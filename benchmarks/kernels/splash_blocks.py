"""Splash attention's tiles on this chip: forward + backward time of the training rows' attention shapes for each
candidate tile set, beside XLA's formulation: the measurement behind the rows of
src/systolic/kernels/splash/tuned_block_sizes.py (run it again for a new chip or a new training shape).

    bash benchmarks/harness/tpu.sh env python3 benchmarks/kernels/splash_blocks.py --json $OUT/splash.jsonl  # chip
    SYSTOLIC_TPU_SH_DRY_RUN=1 python benchmarks/kernels/splash_blocks.py   # CPU, interpreter, tiny shapes: wiring only

No part of tpu.sh runs it (its `train` part times whole steps with the table's tiles); `tpu.sh env` gives it the
same environment. Each candidate is the model's own splash path (`attention.splash_attention`, which
`causal_attention` takes for impl=splash) with the candidate's tiles, under jit: grad of a sum over the output,
bfloat16, the median of 10 calls after 2 warm-up calls. TFLOP/s counts the model's causal FLOPs (half the T x T
square, x3 for forward and backward), as lm/model/flops.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from systolic.kernels.splash.tuned_block_sizes import SplashTiles
from systolic.workloads.lm.model import attention

# (name, batch, heads, kv_heads, seq_len, head_dim): the training rows of benchmarks/harness/tpu_bench.py
SHAPES = (("gpt2-124m 32x1024", 32, 12, 12, 1024, 64), ("llama-1b 4x2048", 4, 32, 8, 2048, 64))
CANDIDATES = (
    SplashTiles(512, 512, 512, False, ""), SplashTiles(512, 512, 512, True, ""),
    SplashTiles(256, 256, 256, True, ""), SplashTiles(512, 256, 256, True, ""),
    SplashTiles(256, 512, 512, True, ""), SplashTiles(1024, 512, 512, True, ""),
    SplashTiles(512, 1024, 512, True, ""), SplashTiles(1024, 1024, 512, True, ""),
    SplashTiles(512, 512, 256, True, ""), SplashTiles(128, 128, 128, True, ""),
    SplashTiles(1024, 1024, 1024, True, ""),
)


def time_call(fn, *args, iters: int = 10) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure(shape, tiles: SplashTiles | None) -> float:
    """Seconds of one forward + backward call: XLA's attention (tiles None), else splash with `tiles`."""
    _, B, H, KV, T, hd = shape
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (B, T, H, hd), jnp.bfloat16)
    k = jax.random.normal(kk, (B, T, KV, hd), jnp.bfloat16)
    v = jax.random.normal(kv, (B, T, KV, hd), jnp.bfloat16)

    def loss(q, k, v):
        out = (attention.causal_attention(q, k, v, impl="xla") if tiles is None else
               attention.splash_attention(q, k, v, tiles=tiles))  # (B, T, H, hd)
        return out.astype(jnp.float32).sum()

    return time_call(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    dry = os.environ.get("SYSTOLIC_TPU_SH_DRY_RUN", "") not in ("", "0")
    shapes = [(n, 1, 4, 2, 256, 64) for n, *_ in SHAPES[:1]] if dry else SHAPES
    candidates = CANDIDATES[:2] if dry else CANDIDATES
    rows = []
    for shape in shapes:
        _, B, H, KV, T, hd = shape
        flops = 3 * 4 * B * H * T * (T / 2) * hd  # QK^T and PV, causal half, forward + backward
        for tiles in (None, *candidates):
            label = "xla" if tiles is None else (f"q{tiles.block_q} kv{tiles.block_kv} c{tiles.block_kv_compute}"
                                                 f"{' fused' if tiles.fused_backward else ''}")
            try:
                seconds = measure(shape, tiles)
                row = dict(shape=shape[0], tiles=label, ms=seconds * 1e3, tflops=flops / seconds / 1e12)
            except Exception as e:  # a tile set the kernel refuses, or out of memory: a row, not the end
                row = dict(shape=shape[0], tiles=label, error=str(e).splitlines()[0][:200])
            rows.append(row)
            if args.json:  # row by row: a run cut short by its time limit keeps what it measured
                with open(args.json, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"kind": "splash_tiles", **row}) + "\n")
            print(f"{row['shape']:<20} {label:<26} " + (f"{row['ms']:8.2f} ms {row['tflops']:6.1f} TFLOP/s"
                                                       if "ms" in row else f"failed: {row['error']}"), flush=True)
            jax.clear_caches()
    # Some tile sets may fail (a row each); none timed means the call itself is broken (or the dry run's wiring).
    return 0 if any("ms" in r for r in rows if r["tiles"] != "xla") else 1


if __name__ == "__main__":
    raise SystemExit(main())
