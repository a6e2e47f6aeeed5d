"""The 2-D turbulence step's transforms on the chip, several ways side by side: what one IFRK4 stage transforms
(four spectral fields back to the grid in one batched inverse, their product forward again), float32.

    bash benchmarks/tpu.sh env python3 benchmarks/fft_variants.py    # on the chip; `python` it anywhere else
    python benchmarks/fft_variants.py --sizes 512 1024 --repeats 20

- `rfft2`: one `irfft2` of the (4, n, n/2) fields and one `rfft2` (the solver's Slab with one device, today);
- `two passes`: the same as two 1-D transforms, along kx then ky (the multi-device Slab's order);
- `two passes, pruned`: only the ky columns the 2/3 rule keeps (ky < n/3, rounded up to 128 lanes: 384 of 512 at
  n = 1,024) go through the kx pass, and the forward pass computes only those: the zeroed modes are never
  transformed. The fields' last axis is then that many columns, not n/2;
- `matmul DFT, pruned`: the pruned transforms as products with the DFT's matrices, at HIGH and HIGHEST precision;
- `paired`: the solver's Slab with `pair_real_transforms` (its TPU default since 2026-12-07): the y passes as complex
  transforms of half the work (two real fields in one inverse; a real row as a complex half-length row forward).
Each prints ms per stage and the largest error against NumPy's float64 transforms of the same fields, relative to
the largest value. On the chip (2026-12-07) systolic's 1,024^2 step ran at 1.34x jax-cfd's; a step is 4 stages.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np
from bench_rows import median_seconds  # sys.path[0]: benchmarks/


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

    # The same pruned transforms as dense matrix products (the DFT's matrices; the matrix unit instead of XLA's FFT
    # code): O(n^3) work, but on the chip's 197 TFLOP/s. Float32 operands at HIGH (three bf16 passes) or HIGHEST.
    x = np.arange(n)
    kx = np.fft.fftfreq(n, 1.0 / n)
    ky = np.arange(m)
    e = np.exp(2j * np.pi * np.outer(x, kx) / n) / n  # (n x, n kx): inverse along kx
    weight = np.where(ky == 0, 1.0, 2.0)[:, None]  # a real signal's ky > 0 stand for +ky and -ky
    c_y = weight * np.cos(2 * np.pi * np.outer(ky, x) / n) / n  # (m, n y)
    s_y = weight * np.sin(2 * np.pi * np.outer(ky, x) / n) / n
    mats = {name: jnp.asarray(a, jnp.float32) for name, a in
            {"er": e.real, "ei": e.imag, "cy": c_y, "sy": s_y, "fr": np.cos(2 * np.pi * np.outer(kx, x) / n),
             "fi": -np.sin(2 * np.pi * np.outer(kx, x) / n), "cyt": np.cos(2 * np.pi * np.outer(x, ky) / n),
             "syt": -np.sin(2 * np.pi * np.outer(x, ky) / n)}.items()}

    def matmul_dft(fields, precision):
        dot = functools.partial(jnp.matmul, precision=precision)
        cr, ci = fields[..., :m].real, fields[..., :m].imag  # (4, n kx, m)
        gr = dot(mats["er"], cr) - dot(mats["ei"], ci)  # (4, n x, m)
        gi = dot(mats["er"], ci) + dot(mats["ei"], cr)
        grid = dot(gr, mats["cy"]) - dot(gi, mats["sy"])  # (4, n x, n y)
        product = grid[0] * grid[2] + grid[1] * grid[3]
        pr, pi = dot(product, mats["cyt"]), dot(product, mats["syt"])  # (n x, m)
        return jax.lax.complex(dot(mats["fr"], pr) - dot(mats["fi"], pi), dot(mats["fr"], pi) + dot(mats["fi"], pr))

    from systolic.workloads.sim.slab import Slab

    slab = Slab(n, pair_real_transforms=True)

    def paired(fields):
        grid = slab.inverse(fields)  # (4, n, n)
        return slab.forward(grid[0] * grid[2] + grid[1] * grid[3])  # (n, n/2)

    return m, {"rfft2": jax.jit(rfft2), "two passes": jax.jit(two_passes),
               "two passes, pruned": jax.jit(lambda f: two_passes(f, m)),
               "matmul DFT, pruned, HIGH": jax.jit(lambda f: matmul_dft(f, jax.lax.Precision.HIGH)),
               "matmul DFT, pruned, HIGHEST": jax.jit(lambda f: matmul_dft(f, jax.lax.Precision.HIGHEST)),
               "paired": jax.jit(paired)}


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
            seconds = median_seconds(fn, (x,), args.repeats)
            got = np.asarray(fn(x))
            columns = got.shape[-1]
            error = np.abs(got - want[:, :columns]).max() / scale
            print(f"| {n} | {name} | {columns} | {seconds * 1e3:.3f} | {error:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
