"""The 2-D turbulence step's transforms on the chip, three ways side by side: what one IFRK4 stage transforms
(four spectral fields back to the grid in one batched inverse, their product forward again), float32.

    python benchmarks/fft_variants.py                    # on the chip (src/ on PYTHONPATH); anywhere on a CPU too
    python benchmarks/fft_variants.py --sizes 512 1024 --repeats 20

- `rfft2`: one `irfft2` of the (4, n, n/2) fields and one `rfft2` (the solver's Slab with one device, today);
- `two passes`: the same as two 1-D transforms, along kx then ky (the multi-device Slab's order);
- `two passes, pruned`: only the ky columns the 2/3 rule keeps (ky < n/3, rounded up to 128 lanes: 384 of 512 at
  n = 1,024) go through the kx pass, and the forward pass computes only those: the zeroed modes are never
  transformed. The fields' last axis is then that many columns, not n/2.
Each prints ms per stage and the largest error against NumPy's float64 transforms of the same fields, relative to
the largest value. On the chip (2026-12-07) systolic's 1,024^2 step ran at 1.34x jax-cfd's; a step is 4 stages.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def kept_columns(n: int) -> int:
    """ky columns the 2/3 rule keeps (ky < n/3), rounded up to a multiple of 128 lanes, at most n/2."""
    return min(n // 2, -(-(n // 3 + 1) // 128) * 128)


def variants(n: int):
    import jax
    import jax.numpy as jnp

    m = kept_columns(n)

    def rfft2(fields):  # (4, n, n/2) complex -> (n, n/2)
        grid = jnp.fft.irfft2(fields, s=(n, n))  # (4, n, n)
        return jnp.fft.rfft2(grid[0] * grid[2] + grid[1] * grid[3])[:, : n // 2]

    def two_passes(fields, columns=n // 2):
        g = jnp.fft.ifft(fields[..., :columns], axis=-2)  # (4, n, columns)
        grid = jnp.fft.irfft(g, n=n, axis=-1)  # pads to n/2 + 1 with zeros: (4, n, n)
        product = grid[0] * grid[2] + grid[1] * grid[3]
        return jnp.fft.fft(jnp.fft.rfft(product, axis=-1)[:, :columns], axis=-2)  # (n, columns)

    return m, {"rfft2": jax.jit(rfft2), "two passes": jax.jit(two_passes),
               "two passes, pruned": jax.jit(lambda f: two_passes(f, m))}


def reference(fields: np.ndarray, n: int) -> np.ndarray:
    grid = np.fft.irfft2(fields.astype(np.complex128), s=(n, n))
    return np.fft.rfft2(grid[0] * grid[2] + grid[1] * grid[3])[:, : n // 2]


def dealiased_fields(n: int) -> np.ndarray:
    """Four random spectral fields with every |k| >= n/3 zero, as the solver's are; (4, n, n/2) complex64."""
    rng = np.random.default_rng(0)
    kx = np.fft.fftfreq(n, 1.0 / n)[:, None]
    ky = np.arange(n // 2)[None, :]
    keep = (np.abs(kx) < n / 3) & (ky < n / 3)
    fields = rng.standard_normal((4, n, n // 2)) + 1j * rng.standard_normal((4, n, n // 2))
    return (fields * keep / (1.0 + kx**2 + ky**2)).astype(np.complex64)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    import jax

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, float32, median of {args.repeats}")
    print("| n | variant | ky columns | ms a stage | max error / max value |")
    print("|---|---|---|---|---|")
    for n in args.sizes:
        fields = dealiased_fields(n)
        want = reference(fields, n)
        scale = np.abs(want).max()
        _, fns = variants(n)
        for name, fn in fns.items():
            x = jax.device_put(fields)
            got = np.asarray(jax.block_until_ready(fn(x)))  # compiles
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                jax.block_until_ready(fn(x))
                times.append(time.perf_counter() - start)
            columns = got.shape[-1]
            error = np.abs(got - want[:, :columns]).max() / scale
            print(f"| {n} | {name} | {columns} | {statistics.median(times) * 1e3:.3f} | {error:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
