"""What XLA's TPU FFTs cost by the TPU compiler's own count: compile-only v5e devices on any host with libtpu
(`pip install 'jax[tpu]'`), no chip. Prints each program's GFLOP and MB accessed from `cost_analysis()`.

    python benchmarks/studies/fft_cost.py                 # 2-D programs at 1024^2, the 3-D stage at 128^3 (~2 min)
    python benchmarks/studies/fft_cost.py --n2 256 --n3 0  # smaller, no 3-D

Rows: the solver's inverse (`irfft2` of 4 half spectra) and its y pass alone, a complex `ifft` of the full length
for comparison, then one solver stage (four fields back, their product forward; 3-D: six back, three forward),
plain and with `pair_real_transforms` (the solvers' TPU default since 2026-12-07, slab.py). The plain real
transforms cost what complex ones of the full length do, which is why the pairing pays on TPUs.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n2", type=int, default=1024, help="2-D grid side")
    parser.add_argument("--n3", type=int, default=128, help="3-D grid side (0: skip)")
    args = parser.parse_args(argv)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only devices touch no chip
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from systolic.workloads.sim.pencil import Pencil
    from systolic.workloads.sim.slab import Slab

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1", chips_per_host_bounds=(1, 1, 1),
                                          wrap=(False, False, False)).devices[0]

    def cost(fn, shape) -> str:
        spectra = jax.ShapeDtypeStruct(shape, jnp.complex64, sharding=SingleDeviceSharding(device))
        analysis = jax.jit(fn).lower(spectra).compile().cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        return f"{analysis['flops'] / 1e9:.3f} | {analysis['bytes accessed'] / 1e6:,.1f}"

    def stage_2d(slab):  # the 2-D solver's stage: u, v, w_x, w_y back; u w_x + v w_y forward
        def run(g):
            u = slab.inverse(g)
            return slab.forward(u[0] * u[2] + u[1] * u[3])
        return run

    def stage_3d(pencil):  # six fields back, three products forward (the 3-D solver's u x w)
        def run(g):
            u = pencil.inverse(g)
            return pencil.forward(u[:3] * u[3:])
        return run

    n = args.n2
    half = (4, n, n // 2)
    print(f"libtpu cost analysis, one v5e device, complex64 (jax {jax.__version__})")
    print("| program | GFLOP | MB accessed |")
    print("|---|---|---|")
    rows = [(f"irfft2 of 4 x {n} x {n // 2} half spectra", lambda g: jnp.fft.irfft2(g, s=(n, n)), half),
            ("  its irfft along y alone", lambda g: jnp.fft.irfft(g, n=n, axis=-1), half),
            (f"complex ifft along y of 4 x {n} x {n}", lambda g: jnp.fft.ifft(g, axis=-1), (4, n, n)),
            (f"2-D stage at {n}^2, plain", stage_2d(Slab(n)), half),
            (f"2-D stage at {n}^2, paired", stage_2d(Slab(n, pair_real_transforms=True)), half)]
    if args.n3:
        m = args.n3
        rows += [(f"3-D stage at {m}^3, plain", stage_3d(Pencil(m)), (6, m, m, m // 2)),
                 (f"3-D stage at {m}^3, paired", stage_3d(Pencil(m, pair_real_transforms=True)), (6, m, m, m // 2))]
    for name, fn, shape in rows:
        print(f"| {name} | {cost(fn, shape)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
