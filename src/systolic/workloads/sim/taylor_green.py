"""The Taylor-Green vortex at Re = 1600: the published dissipation curve, a run's peak against it, and the figure.

The reference (`reference/taylor_green_re1600.csv`, its header says exactly what it is and where it comes from) is
the 512^3 pseudo-spectral DNS of the High-Order CFD workshops' case C3.5, every 0.05 in time: mean kinetic energy
and its dissipation rate -dE/dt. It applies to `navier_stokes_3d.initial=taylor_green` with V = 1, k = 1 on
[0, 2 pi)^3 and viscosity 1/1600; `is_reference_case` says whether a config is that case.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from systolic.workloads.sim.config import SimConfig

REFERENCE = Path(__file__).parent / "reference" / "taylor_green_re1600.csv"
REYNOLDS = 1600.0


@dataclasses.dataclass(frozen=True)
class Peak:
    time: float
    value: float


def is_reference_case(cfg: SimConfig) -> bool:
    flow = cfg.navier_stokes_3d
    return (cfg.sim.equation == "navier_stokes_3d" and flow.initial == "taylor_green" and flow.initial_wavenumber == 1
            and math.isclose(cfg.grid.length, 2 * math.pi, rel_tol=1e-9) and flow.viscosity > 0
            and math.isclose(flow.velocity / flow.viscosity, REYNOLDS, rel_tol=1e-6))


def load_reference() -> np.ndarray:
    """(rows, 3): time, energy, dissipation rate."""
    rows = [line for line in REFERENCE.read_text().splitlines() if line and not line.startswith("#")]
    assert rows[0] == "time,energy,dissipation", rows[0]
    return np.array([[float(v) for v in row.split(",")] for row in rows[1:]])


def peak(time: np.ndarray, value: np.ndarray) -> Peak:
    """The maximum of a sampled curve, refined by the parabola through the largest sample and its neighbours (on
    equally spaced samples; at an end of the series, the largest sample itself)."""
    i = int(np.argmax(value))
    if i == 0 or i == len(value) - 1:
        return Peak(float(time[i]), float(value[i]))
    y0, y1, y2 = value[i - 1: i + 2]
    h = 0.5 * (time[i + 1] - time[i - 1])
    curvature = y0 - 2 * y1 + y2
    offset = 0.5 * (y0 - y2) / curvature if curvature < 0 else 0.0  # in samples, within (-1/2, 1/2) at a maximum
    return Peak(float(time[i] + offset * h), float(y1 - 0.25 * (y0 - y2) * offset))


def reference_peak() -> Peak:
    ref = load_reference()
    return peak(ref[:, 0], ref[:, 2])


def compare(time: np.ndarray, dissipation: np.ndarray) -> dict[str, float] | None:
    """The run's dissipation peak against the reference's: heights, times and relative errors. None when the run
    ends before its curve has turned over (its last sample is its largest)."""
    if len(time) < 3 or int(np.argmax(dissipation)) == len(time) - 1:
        return None
    mine, theirs = peak(time, dissipation), reference_peak()
    return {"peak": mine.value, "peak_time": mine.time, "reference_peak": theirs.value,
            "reference_peak_time": theirs.time, "peak_error": mine.value / theirs.value - 1,
            "peak_time_error": mine.time / theirs.time - 1}


Series = tuple[str, np.ndarray, np.ndarray, np.ndarray]  # label, time, energy, dissipation rate


def plot_dissipation(runs: list[Series], out: Path, *, reference: bool) -> Path:
    """Kinetic energy and dissipation rate against time for each run, beside the published curves when
    `reference`."""
    from systolic.observe.plot import save_figure
    from systolic.workloads.sim.outputs import pyplot

    plt = pyplot()
    fig, (ax_e, ax_d) = plt.subplots(2, 1, figsize=(7, 6), dpi=110, sharex=True)
    if reference:
        ref = load_reference()
        for ax, column in ((ax_e, 1), (ax_d, 2)):
            ax.plot(ref[:, 0], ref[:, column], color="black", lw=1, label="512^3 spectral DNS (HiOCFD C3.5)")
    colours = ("C3", "C0", "C2", "C1", "C4", "C5")  # kept apart from the reference's black
    for i, (label, time, energy, dissipation) in enumerate(runs):
        colour = colours[i % len(colours)]
        ax_e.plot(time, energy, color=colour, lw=1.5, label=label)
        ax_d.plot(time, dissipation, color=colour, lw=1.5, label=label)
    ax_e.set_ylabel("kinetic energy")
    ax_d.set_ylabel("dissipation rate  2 nu Omega")
    ax_d.set_xlabel("t (V0 = L = 1)")
    for ax in (ax_e, ax_d):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Taylor-Green vortex" + (", Re = 1600" if reference else ""))
    fig.tight_layout()
    save_figure(fig, out)
    return out
