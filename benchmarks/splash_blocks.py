"""Splash attention's tiles on this chip: forward + backward time of the training rows' attention shapes for each
candidate tile set (lm/model/splash_blocks.py holds the chosen rows), beside XLA's formulation.

    python benchmarks/splash_blocks.py                 # on the TPU (benchmarks/tpu.sh train runs it first)
    python benchmarks/splash_blocks.py --json out.jsonl
    SYSTOLIC_TPU_SH_DRY_RUN=1 python benchmarks/splash_blocks.py   # CPU, interpreter, tiny shapes: wiring only

Each candidate is `causal_attention` (the model's own call) under jit: grad of a sum over the output, bfloat16,
the median of 10 calls after 2 warm-up calls. TFLOP/s counts the model's causal FLOPs (half the T x T square, x3
for forward and backward), as lm/model/flops.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from systolic.workloads.lm.model import attention, splash_blocks
from systolic.workloads.lm.model.splash_blocks import SplashTiles

# (name, batch, heads, kv_heads, seq_len, head_dim): the training rows of benchmarks/tpu_bench.py
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


def measure(shape, impl: str, tiles: SplashTiles | None) -> float:
    _, B, H, KV, T, hd = shape
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (B, T, H, hd), jnp.bfloat16)
    k = jax.random.normal(kk, (B, T, KV, hd), jnp.bfloat16)
    v = jax.random.normal(kv, (B, T, KV, hd), jnp.bfloat16)

    def loss(q, k, v):
        return attention.causal_attention(q, k, v, impl=impl).astype(jnp.float32).sum()

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    if tiles is None:
        return time_call(step, q, k, v)
    with mock.patch.object(splash_blocks, "tiles_for", lambda head_dim: tiles):
        return time_call(step, q, k, v)


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
                seconds = measure(shape, "xla" if tiles is None else "splash", tiles)
                row = dict(shape=shape[0], tiles=label, ms=seconds * 1e3, tflops=flops / seconds / 1e12)
            except Exception as e:  # a tile set the kernel refuses, or out of memory: a row, not the end
                row = dict(shape=shape[0], tiles=label, error=str(e).splitlines()[0][:200])
            rows.append(row)
            print(f"{row['shape']:<20} {label:<26} " + (f"{row['ms']:8.2f} ms {row['tflops']:6.1f} TFLOP/s"
                                                       if "ms" in row else f"failed: {row['error']}"), flush=True)
            jax.clear_caches()
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"kind": "splash_tiles", **r}) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
