"""The Taylor-Green vortex at Re = 1600 (docs/sim3d.md): finished runs' dissipation peaks against the 512^3 reference,
as a table, and their curves in one figure.

    systolic simulate --recipe sim-taylor-green-3d grid.n=64 --run-dir runs/tgv64
    systolic simulate --recipe sim-taylor-green-3d --run-dir runs/tgv128            # 128^3
    systolic simulate --recipe sim-taylor-green-3d grid.n=192 sim.t_end=11 output.frames=110 --run-dir runs/tgv192
    .venv/bin/python benchmarks/studies/taylor_green_3d.py runs/tgv64 runs/tgv128 runs/tgv192 \
        --out docs/images/taylor-green-3d.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from systolic.engine import rundir
from systolic.workloads.sim import outputs, taylor_green
from systolic.workloads.sim.config import SimConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories of sim-taylor-green-3d")
    parser.add_argument("--out", type=Path, help="the figure (PNG) of every run against the reference")
    args = parser.parse_args()
    ref = taylor_green.reference_peak()
    print(f"reference (512^3 spectral DNS): peak dissipation {ref.value:.5f} at t = {ref.time:.3f}")
    print("| grid | dtype | t_end | frames | peak dissipation | at t | height error | time error |")
    print("|---|---|---|---|---|---|---|---|")
    series = []
    for run in args.runs:
        cfg = rundir.load_config(run, lambda name: SimConfig)
        if not taylor_green.is_reference_case(cfg):
            raise SystemExit(f"{run} is not the Re = 1600 Taylor-Green case of the reference (sim-taylor-green-3d).")
        time, energy, dissipation = outputs.series(run, "time", "energy", "dissipation")
        found = taylor_green.compare(time, dissipation)
        cells = (f"{found['peak']:.5f} | {found['peak_time']:.3f} | {100 * found['peak_error']:+.2f}% | "
                 f"{100 * found['peak_time_error']:+.2f}%" if found else "not reached | | |")
        print(f"| {cfg.grid.n}^3 | {cfg.sim.dtype} | {time[-1]:g} | {len(time) - 1} | {cells} |")
        series.append((f"{cfg.grid.n}^3, {cfg.sim.dtype}", time, energy, dissipation))
    if args.out:
        taylor_green.plot_dissipation(series, args.out, reference=True)
        print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
