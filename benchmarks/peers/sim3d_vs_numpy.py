"""The 3-D spectral Navier-Stokes step in NumPy against systolic's, on this machine: seconds per step and the ratio.

    .venv/bin/python benchmarks/peers/sim3d_vs_numpy.py                 # 64^3 and 128^3, float32 (the recipe's dtype)
    .venv/bin/python benchmarks/peers/sim3d_vs_numpy.py --dtype float64 --sizes 32 64

Both run the same algorithm on one device, step for step, from the same Taylor-Green field (Re = 1600): velocity
form with the nonlinear term as u x w, real 3-D FFTs with the Nyquist plane dropped, the six inverse transforms
(u and w) batched into one call and the three forward ones into another, 2/3-rule dealiasing, the projection
P = I - k k^T / |k|^2, Lawson RK4 with the exact integrating factor exp(-nu k^2 dt / 2), a fixed dt. The NumPy
version is written the way one would write it by hand for speed (precomputed operators, batched FFTs into a
preallocated buffer, no Python loops over the grid). The two sides alternate, each timed `--repeats` times, best
time kept; compilation and a NumPy warm-up step are not timed. The table also reports how far apart the two
results are after the timed steps.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import time

import numpy as np


class NumpySolver3D:
    """IFRK4 pseudo-spectral 3-D Navier-Stokes on [0, 2 pi)^3; u_hat is (3, n, n, n/2) like systolic's layout."""

    def __init__(self, n: int, viscosity: float, dt: float, dtype: str = "float32"):
        self.n, self.dt = n, dt
        real = np.dtype(dtype)
        cplx = np.result_type(real, np.complex64)
        kx = np.fft.fftfreq(n, 1.0 / n)[:, None, None]  # (n, 1, 1)
        ky = np.fft.fftfreq(n, 1.0 / n)[None, :, None]  # (1, n, 1)
        kz = np.arange(n // 2)[None, None, :]  # (1, 1, n/2)
        k2 = kx**2 + ky**2 + kz**2
        self.k = [k.astype(cplx) for k in (kx, ky, kz)]
        self.ik = [(1j * k).astype(cplx) for k in (kx, ky, kz)]
        self.inv_k2 = np.where(k2 > 0, 1 / np.where(k2 > 0, k2, 1), 0).astype(real)
        self.dealias = ((3 * np.abs(kx) < n) & (3 * np.abs(ky) < n) & (3 * kz < n)).astype(real)
        self.decay = np.exp(-viscosity * k2 * (0.5 * dt)).astype(real)  # exp(L dt / 2)
        self._fields = np.zeros((6, n, n, n // 2 + 1), cplx)  # u, w; the Nyquist plane stays zero
        self._cross = np.empty((3, n, n, n), real)
        self.real = real

    def nonlinear(self, u_hat: np.ndarray) -> np.ndarray:
        n, f, (ikx, iky, ikz) = self.n, self._fields, self.ik
        half = f[..., : n // 2]
        half[:3] = u_hat
        np.subtract(iky * u_hat[2], ikz * u_hat[1], out=half[3])  # w = i k x u
        np.subtract(ikz * u_hat[0], ikx * u_hat[2], out=half[4])
        np.subtract(ikx * u_hat[1], iky * u_hat[0], out=half[5])
        (ux, uy, uz, wx, wy, wz) = np.fft.irfftn(f, s=(n, n, n), axes=(1, 2, 3))  # one batched inverse transform
        c = self._cross
        np.subtract(uy * wz, uz * wy, out=c[0])  # u x w
        np.subtract(uz * wx, ux * wz, out=c[1])
        np.subtract(ux * wy, uy * wx, out=c[2])
        h = np.fft.rfftn(c, axes=(1, 2, 3))[..., : n // 2]
        h *= self.dealias
        kx, ky, kz = self.k
        k_dot_h = (kx * h[0] + ky * h[1] + kz * h[2]) * self.inv_k2
        h[0] -= kx * k_dot_h  # the projection onto divergence-free fields
        h[1] -= ky * k_dot_h
        h[2] -= kz * k_dot_h
        return h

    def step(self, u: np.ndarray) -> np.ndarray:
        e, dt, rhs = self.decay, self.dt, self.nonlinear
        a = rhs(u)
        b = rhs(e * (u + 0.5 * dt * a))
        c = rhs(e * u + 0.5 * dt * b)
        e2u = e * e * u
        d = rhs(e2u + dt * e * c)
        return e2u + dt / 6 * (e * e * a + 2 * e * (b + c) + d)


def systolic_simulation(n: int, viscosity: float, dt: float, steps: int, dtype: str):
    """systolic's solver for the same problem on one device, one frame = `steps` fixed steps."""
    import jax

    from systolic import config as config_lib
    from systolic.config import MeshConfig
    from systolic.runtime.mesh import make_mesh
    from systolic.workloads.sim.config import SimConfig
    from systolic.workloads.sim.solver import make_simulation

    overrides = ["sim.equation=navier_stokes_3d", f"grid.n={n}", f"sim.dt={dt}", f"sim.t_end={dt * steps}",
                 "output.frames=1", f"sim.dtype={dtype}", f"navier_stokes_3d.viscosity={viscosity}"]
    cfg = config_lib.from_dict(SimConfig, config_lib.apply_overrides({}, overrides))
    return make_simulation(cfg, make_mesh(MeshConfig(data=1), devices=jax.devices()[:1]))


def compare(n: int, steps: int, dtype: str = "float32", viscosity: float = 1 / 1600,
            repeats: int = 3) -> dict[str, float]:
    """Times `steps` steps of each from the same initial field, `repeats` times alternating, and keeps each one's
    best time (other processes on a shared machine only ever make a run slower)."""
    import jax

    dt = 0.5 * (2 * math.pi / n)  # CFL 0.5 for Taylor-Green's initial max(|u| + |v| + |w|) = 1
    sim = systolic_simulation(n, viscosity, dt, steps, dtype)
    state = sim.initial_state()
    u0 = np.asarray(state.params["u_hat"])
    np_solver = NumpySolver3D(n, viscosity, dt, dtype)
    np_solver.step(u0.copy())  # warm-up: FFT plans, page faults
    compiled = sim.frame_step.lower(state, None).compile()

    numpy_s = systolic_s = numpy_cpu = systolic_cpu = math.inf
    for _ in range(repeats):
        u = u0.copy()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            u = np_solver.step(u)
        numpy_s, numpy_cpu = min(numpy_s, time.perf_counter() - t), min(numpy_cpu, time.process_time() - c)

        start = jax.tree.map(lambda x: x.copy(), state)  # the step donates its input
        jax.block_until_ready(start)
        t, c = time.perf_counter(), time.process_time()
        out, _ = compiled(start, None)
        jax.block_until_ready(out)
        systolic_s, systolic_cpu = min(systolic_s, time.perf_counter() - t), min(systolic_cpu, time.process_time() - c)
    u_jax = np.asarray(out.params["u_hat"])
    diff = float(np.max(np.abs(u_jax - u)) / np.max(np.abs(u)))
    return {"n": n, "steps": steps, "numpy_s_per_step": numpy_s / steps, "systolic_s_per_step": systolic_s / steps,
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
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--steps", type=int, default=0, help="steps per size (0: 10 at 64^3, 3 at 128^3 and above)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each, alternating; the best counts")
    args = parser.parse_args()
    import jax

    from systolic.runtime import cpu_tuning

    cpu_tuning.apply_at_start(workload="sim", stepping=True)  # what `systolic simulate` runs with
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{datetime.date.today()} | {_cpu_name()}, {os.cpu_count()} cores, load average {load:.2f} at start | "
          f"jax {jax.__version__} ({jax.default_backend()}), numpy {np.__version__} | {args.dtype}, best of "
          f"{args.repeats}, alternating")
    # ratio: wall-clock speed-up. CPU ratio: NumPy's CPU seconds over systolic's (all threads counted), i.e. the
    # speed-up per core, which other processes on a shared machine disturb far less than wall-clock time.
    print("| grid | steps | NumPy s/step | systolic s/step | ratio | CPU-time ratio | max rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        steps = args.steps or (10 if n <= 64 else 3)
        r = compare(n, steps, args.dtype, repeats=args.repeats)
        print(f"| {n}^3 | {steps} | {r['numpy_s_per_step']:.3f} | {r['systolic_s_per_step']:.3f} | "
              f"{r['ratio']:.1f}x | {r['cpu_ratio']:.1f}x | {r['max_rel_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
