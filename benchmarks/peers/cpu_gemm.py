"""float32 GEMM rates on the lm benchmark's shapes: NumPy (OpenBLAS), PyTorch, and XLA:CPU with each dot backend.

Each column runs in its own process (XLA reads XLA_FLAGS once per process); 10 timed calls after a warm-up.

    python benchmarks/peers/cpu_gemm.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SHAPES = [(2048, 384, 1152), (2048, 384, 1536), (2048, 1536, 384), (384, 2048, 1536), (1536, 2048, 384)]
XLA = {
    "XLA default": "",
    "XLA + XNNPACK": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_xnn_fusion_type=dot",
    "XLA + oneDNN": "--xla_cpu_experimental_onednn_fusion_type=dot",
}


def _time(f, *args, n: int = 10) -> float:
    r = f(*args)
    t = time.perf_counter()
    for _ in range(n):
        r = f(*args)
    if hasattr(r, "block_until_ready"):
        r.block_until_ready()
    return (time.perf_counter() - t) / n


def worker(kind: str) -> None:
    import numpy as np

    rates = []
    for m, k, n in SHAPES:
        a, b = np.random.rand(m, k).astype(np.float32), np.random.rand(k, n).astype(np.float32)
        if kind == "numpy":
            seconds = _time(np.matmul, a, b)
        elif kind == "torch":
            import torch

            torch.set_num_threads(os.cpu_count() or 1)
            seconds = _time(torch.matmul, torch.from_numpy(a), torch.from_numpy(b))
        else:
            import jax
            import jax.numpy as jnp

            seconds = _time(jax.jit(jnp.matmul), jnp.asarray(a), jnp.asarray(b))
        rates.append(2 * m * k * n / seconds / 1e9)
    print(json.dumps(rates))


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return 0
    columns = {"NumPy": ("numpy", None), "PyTorch": ("torch", None)}
    columns.update({name: ("jax", flags) for name, flags in XLA.items()})
    results = {}
    for name, (kind, flags) in columns.items():
        env = dict(os.environ, SYSTOLIC_XLA_CPU_FLAGS="off")
        if flags is not None:
            env["XLA_FLAGS"] = flags
        proc = subprocess.run([sys.executable, __file__, "--worker", kind], env=env, capture_output=True, text=True)
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    print(f"float32 GEMM GFLOP/s, {os.cpu_count()} CPUs")
    print(f"{'M x K x N':<18}" + "".join(f"{name:>15}" for name in results))
    for i, (m, k, n) in enumerate(SHAPES):
        cells = "".join(f"{r[i]:>15.1f}" if r else f"{'failed':>15}" for r in results.values())
        print(f"{f'{m} x {k} x {n}':<18}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
