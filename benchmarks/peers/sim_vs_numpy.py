"""The spectral Navier-Stokes step in NumPy against systolic's, on this machine: steps/s and the ratio.

    .venv/bin/python benchmarks/peers/sim_vs_numpy.py                 # 256^2 .. 2048^2, float32 (sim's default)
    .venv/bin/python benchmarks/peers/sim_vs_numpy.py --dtype float64 --sizes 256 512

Both run the same algorithm on one device, step for step: vorticity form, real FFTs with the Nyquist column
dropped, the four inverse transforms (u, v, w_x, w_y) batched into one call, 2/3-rule dealiasing, Lawson RK4
with the exact integrating factor exp(-nu k^2 dt / 2), a fixed dt. The NumPy version is written the way one
would write it by hand for speed (precomputed operators, batched FFTs, no Python loops over the grid); NumPy's
FFT runs on one core, XLA's on all of them, and XLA fuses the element-wise work between the transforms. Both
start from the same field, and the table reports how far apart their results are after the timed steps.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import time

import numpy as np


class NumpySolver:
    """IFRK4 pseudo-spectral 2-D Navier-Stokes on [0, 2 pi)^2; w_hat is (n, n/2) like systolic's layout."""

    def __init__(self, n: int, viscosity: float, dt: float, dtype: str = "float32"):
        self.n, self.dt = n, dt
        real = np.dtype(dtype)
        cplx = np.result_type(real, np.complex64)
        kx = np.fft.fftfreq(n, 1.0 / n)[:, None]  # (n, 1)
        ky = np.arange(n // 2)[None, :]  # (1, n/2)
        k2 = (kx**2 + ky**2).astype(real)
        self.inv_k2 = np.where(k2 > 0, 1 / np.where(k2 > 0, k2, 1), 0).astype(real)
        self.dealias = ((3 * np.abs(kx) < n) & (3 * ky < n)).astype(real)
        self.ikx = (1j * kx).astype(cplx)
        self.iky = (1j * ky).astype(cplx)
        self.decay = np.exp(-viscosity * k2 * (0.5 * dt)).astype(real)  # exp(L dt / 2)
        self._fields = np.zeros((4, n, n // 2 + 1), cplx)  # the Nyquist column stays zero
        self.real = real

    def nonlinear(self, w_hat: np.ndarray) -> np.ndarray:
        n, f = self.n, self._fields
        psi = w_hat * self.inv_k2
        np.multiply(self.iky, psi, out=f[0, :, : n // 2])  # u = psi_y
        np.multiply(self.ikx, psi, out=f[1, :, : n // 2])
        np.negative(f[1, :, : n // 2], out=f[1, :, : n // 2])  # v = -psi_x
        np.multiply(self.ikx, w_hat, out=f[2, :, : n // 2])  # w_x
        np.multiply(self.iky, w_hat, out=f[3, :, : n // 2])  # w_y
        u, v, wx, wy = np.fft.irfft2(f, s=(n, n))  # one batched inverse transform
        advection = u * wx
        advection += v * wy
        out = np.fft.rfft2(advection.astype(self.real, copy=False))[:, : n // 2]
        out *= self.dealias
        return np.negative(out, out=out)

    def step(self, w: np.ndarray) -> np.ndarray:
        e, dt, rhs = self.decay, self.dt, self.nonlinear
        a = rhs(w)
        b = rhs(e * (w + 0.5 * dt * a))
        c = rhs(e * w + 0.5 * dt * b)
        e2w = e * e * w
        d = rhs(e2w + dt * e * c)
        return e2w + dt / 6 * (e * e * a + 2 * e * (b + c) + d)


def systolic_simulation(n: int, viscosity: float, dt: float, steps: int, dtype: str):
    """systolic's solver for the same problem on one device, one frame = `steps` fixed steps."""
    import jax

    from systolic import config as config_lib
    from systolic.config import MeshConfig
    from systolic.runtime.mesh import make_mesh
    from systolic.workloads.sim.config import SimConfig
    from systolic.workloads.sim.solver import make_simulation

    overrides = [f"grid.n={n}", f"sim.dt={dt}", f"sim.t_end={dt * steps}", "output.frames=1", f"sim.dtype={dtype}",
                 f"navier_stokes.viscosity={viscosity}", "navier_stokes.initial_wavenumber=8"]
    cfg = config_lib.from_dict(SimConfig, config_lib.apply_overrides({}, overrides))
    return make_simulation(cfg, make_mesh(MeshConfig(data=1), devices=jax.devices()[:1]))


def compare(n: int, steps: int, dtype: str = "float32", viscosity: float = 1e-3, repeats: int = 3) -> dict[str, float]:
    """Times `steps` steps of each from the same initial field, `repeats` times interleaved, and keeps each
    one's best time (other processes on a shared machine only ever make a run slower). Compilation and a
    NumPy warm-up step are not timed."""
    import jax

    dt = 0.5 * (2 * math.pi / n) / 4.0  # CFL ~0.5 for velocities up to ~4
    sim = systolic_simulation(n, viscosity, dt, steps, dtype)
    state = sim.initial_state()
    w0 = np.asarray(state.params["w_hat"])
    np_solver = NumpySolver(n, viscosity, dt, dtype)
    np_solver.step(w0.copy())  # warm-up: FFT plans, page faults
    compiled = sim.frame_step.lower(state, None).compile()

    numpy_s = systolic_s = numpy_cpu = systolic_cpu = math.inf
    for _ in range(repeats):
        w = w0.copy()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            w = np_solver.step(w)
        numpy_s, numpy_cpu = min(numpy_s, time.perf_counter() - t), min(numpy_cpu, time.process_time() - c)

        start = jax.tree.map(lambda x: x.copy(), state)  # the step donates its input
        jax.block_until_ready(start)
        t, c = time.perf_counter(), time.process_time()
        out, _ = compiled(start, None)
        jax.block_until_ready(out)
        systolic_s, systolic_cpu = min(systolic_s, time.perf_counter() - t), min(systolic_cpu, time.process_time() - c)
    w_jax = np.asarray(out.params["w_hat"])
    diff = float(np.max(np.abs(w_jax - w)) / np.max(np.abs(w)))
    return {"n": n, "steps": steps, "numpy_steps_per_s": steps / numpy_s, "systolic_steps_per_s": steps / systolic_s,
            "ratio": numpy_s / systolic_s, "cpu_ratio": numpy_cpu / systolic_cpu, "max_rel_diff": diff}


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--steps", type=int, default=0, help="steps per size (0: 20 at 256^2, fewer for larger grids)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each; the best counts")
    args = parser.parse_args()
    if args.dtype == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)
    import jax

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{datetime.date.today()} | {_cpu_name()}, {os.cpu_count()} cores, "
          f"load average {load:.2f} at start | jax {jax.__version__} ({jax.default_backend()}), numpy {np.__version__} "
          f"| {args.dtype}, best of {args.repeats}")
    # ratio: wall-clock speed-up. CPU ratio: NumPy's CPU seconds over systolic's (all threads counted), i.e. the
    # speed-up per core, which other processes on a shared machine disturb far less than wall-clock time.
    print("| grid | steps | NumPy steps/s | systolic steps/s | ratio | CPU-time ratio | max rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        steps = args.steps or max(3, 20 * 256**2 // n**2)
        r = compare(n, steps, args.dtype, repeats=args.repeats)
        print(f"| {n}^2 | {steps} | {r['numpy_steps_per_s']:.2f} | {r['systolic_steps_per_s']:.2f} | "
              f"{r['ratio']:.1f}x | {r['cpu_ratio']:.1f}x | {r['max_rel_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
