"""2-D spectral turbulence: systolic's solver against jax-cfd's, on the caller's platform: steps/s and the ratio.

    python benchmarks/peers/sim_vs_jax_cfd.py                        # 256^2 and 512^2, float32
    python benchmarks/peers/sim_vs_jax_cfd.py --sizes 1024 --steps 1000 --json out.jsonl   # the chip's (tpu.sh sim)

The peer is jax-cfd 0.2.1's own pseudo-spectral solver, unchanged: `jax_cfd.spectral.equations.NavierStokes2D(
viscosity, grid, smooth=True)` stepped by `time_stepping.crank_nicolson_rk4(eq, dt)`, `funcutils.repeated(step,
steps)` under `jax.jit`; its state is rfftn of the vorticity, (n, n/2 + 1). systolic's is `w_hat`, (n, n/2) without
the Nyquist column (sim_vs_numpy.py's problem, beside this file: a random vorticity field with its energy spectrum
peaked at k = 8, viscosity 1e-3, dt = 0.5 dx / 4, fixed). Both start from the same vorticity (handed over in real
space), float32, on JAX's default device, and each runs `--steps` steps as one compiled program. What is measured:
steps/s = steps / the wall time of one call of that program until its result is ready, the best of `--repeats`
calls, the two sides alternating (other processes only ever make a run slower); compilation is not timed.

What is compared: the same equation (vorticity form, w_t + u . grad w = nu lap w) with the same 2/3-rule
dealiasing of the advection term, the same real FFTs (four inverse transforms and one forward per evaluation of
the advection term; systolic batches the four into one call) and the same dt, but different time integrators:
jax-cfd's Crank-Nicolson RK4 (Carpenter-Kennedy, low-storage IMEX: fourth order in the advection, second in the
viscous term) evaluates the advection term in 5 stages per step, systolic's Lawson RK4 (integrating factor: the
viscous term exact) in 4. So a jax-cfd step does 25 transforms to systolic's 20, and steps/s at the same dt is the
figure a user gets for the same simulated time. The two results agree to the integrators' error, not to
round-off; and jax-cfd's 2/3 mask (`spectral.utils.brick_wall_filter_2d`) is one row off systolic's |kx| < n/3 in
kx: it drops the kx = +floor(n/3) row (n = 64, 256, 1024; for n = 512 it also keeps kx = -171), a band that
holds little of a field peaked at k = 8 once n >= 128. The agreement columns: the relative difference of the mean
kinetic energy and of the enstrophy, and the largest vorticity difference relative to the largest vorticity, after
the timed steps. Measured on CPU (2026-12-06, 10 steps): at 64^2 with the peak at k = 4, energy and enstrophy
within 6e-7 at dt and at dt / 2 alike (the integrators' difference is below float32 round-off there) and the
vorticity within 1.5e-3 (the mask's row); a viscosity 10% off on one side moves energy by 5e-4.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HARNESS = Path(__file__).resolve().parents[1] / "harness"  # tpu_profile.py, for --trace
PEAK_MODE = 8  # the initial energy spectrum's peak, as benchmarks/peers/sim_vs_numpy.py
VISCOSITY = 1e-3


def systolic_simulation(n: int, viscosity: float, dt: float, steps: int, peak_mode: int = PEAK_MODE):
    """systolic's 2-D solver on one device, float32, one frame = `steps` fixed steps of `dt`."""
    import jax

    from systolic import config as config_lib
    from systolic.config import MeshConfig
    from systolic.runtime.mesh import make_mesh
    from systolic.workloads.sim.config import SimConfig
    from systolic.workloads.sim.solver import make_simulation

    overrides = [f"grid.n={n}", f"sim.dt={dt}", f"sim.t_end={dt * steps}", "output.frames=1", "sim.dtype=float32",
                 f"navier_stokes.viscosity={viscosity}", f"navier_stokes.initial_wavenumber={peak_mode}"]
    cfg = config_lib.from_dict(SimConfig, config_lib.apply_overrides({}, overrides))
    return make_simulation(cfg, make_mesh(MeshConfig(data=1), devices=jax.devices()[:1]))


def jax_cfd_program(n: int, viscosity: float, dt: float, steps: int):
    """jax-cfd's solver for the same problem, compiled: rfftn(vorticity) (n, n/2 + 1) -> the same after `steps`."""
    import jax
    import jax.numpy as jnp
    from jax_cfd.base import funcutils, grids
    from jax_cfd.spectral import equations, time_stepping

    grid = grids.Grid((n, n), domain=((0, 2 * math.pi), (0, 2 * math.pi)))
    # jax-cfd is written for JAX's standard dtype promotion (it multiplies complex64 spectra by float32 masks);
    # tracing happens here, so a caller's strict promotion (the test suite's) must not apply to it.
    with jax.numpy_dtype_promotion("standard"):
        equation = equations.NavierStokes2D(viscosity, grid, smooth=True)
        run = jax.jit(funcutils.repeated(time_stepping.crank_nicolson_rk4(equation, dt), steps))
        return run.lower(jax.ShapeDtypeStruct((n, n // 2 + 1), jnp.complex64)).compile()


def vorticity_of_systolic(w_hat: np.ndarray) -> np.ndarray:
    """systolic's (n, n/2) spectrum -> the real vorticity (n, n), float64; the dropped Nyquist column is zero."""
    n = w_hat.shape[0]
    return np.fft.irfft2(np.asarray(w_hat, np.complex128), s=(n, n))


def agreement(w: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """How far vorticity `w` is from `reference` (both real (n, n)): relative differences of the mean kinetic
    energy 1/2 <|u|^2> and the enstrophy 1/2 <w^2>, and max |w - reference| / max |reference|."""

    def energy_enstrophy(field):
        n = field.shape[0]
        power = np.abs(np.fft.fft2(field)) ** 2 / n**4  # mean of w^2 = sum |w_hat|^2 / n^4
        k = np.fft.fftfreq(n, 1.0 / n)
        k2 = k[:, None] ** 2 + k[None, :] ** 2
        return 0.5 * np.sum(power / np.where(k2 > 0, k2, np.inf)), 0.5 * np.sum(power)  # |u_hat|^2 = |w_hat|^2 / k^2

    (e, z), (e_ref, z_ref) = energy_enstrophy(w), energy_enstrophy(reference)
    return {"energy_rel_diff": abs(e - e_ref) / e_ref, "enstrophy_rel_diff": abs(z - z_ref) / z_ref,
            "max_rel_diff": float(np.max(np.abs(w - reference)) / np.max(np.abs(reference)))}


def compare(n: int, steps: int, viscosity: float = VISCOSITY, repeats: int = 3, peak_mode: int = PEAK_MODE,
            jax_cfd_viscosity: float | None = None, trace: Path | None = None) -> dict[str, float]:
    """Times `steps` steps of each side from the same initial vorticity, `repeats` times alternating, best time
    each; returns steps/s, the ratio (systolic over jax-cfd) and the agreement after the steps.
    `jax_cfd_viscosity` (default: `viscosity`) gives the peer another viscosity: the test's check that a wrong
    equation shows in the agreement. With `trace`, one more call of each runs under the profiler, into
    trace/sim-{systolic,jax-cfd}-<n>.xplane.pb (read with `python benchmarks/harness/tpu_profile.py --summarize
    FILE`)."""
    import jax
    import jax.numpy as jnp

    dt = 0.5 * (2 * math.pi / n) / 4.0  # CFL ~0.5 for velocities up to ~4, as benchmarks/peers/sim_vs_numpy.py
    sim = systolic_simulation(n, viscosity, dt, steps, peak_mode)
    state = sim.initial_state()
    w0 = vorticity_of_systolic(np.asarray(state.params["w_hat"]))  # (n, n) real: what both start from
    peer_start = jax.device_put(jnp.fft.rfftn(jnp.asarray(w0, jnp.float32)), jax.devices()[0])
    t = time.perf_counter()
    # Both at once: the TPU compiler took 261 s for jax-cfd's 1024^2 program of 1,000 steps on this project's loaded
    # 2-core host (libtpu AOT, 2026-12-06: 25 separate transforms a step, each expanded), and the chip's host has 13.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # sim.dt: the step that the frame's fixed steps take exactly (dt adjusted to fit the frame, by round-off)
        peer_job = pool.submit(jax_cfd_program, n, viscosity if jax_cfd_viscosity is None else jax_cfd_viscosity,
                               sim.dt, steps)
        compiled, peer = sim.frame_step.lower(state, None).compile(), peer_job.result()
    compile_s = time.perf_counter() - t

    peer_s = systolic_s = math.inf
    for _ in range(repeats):
        jax.block_until_ready(peer_start)
        t = time.perf_counter()
        peer_out = jax.block_until_ready(peer(peer_start))
        peer_s = min(peer_s, time.perf_counter() - t)

        start = jax.tree.map(lambda x: x.copy(), state)  # the frame step donates its input
        jax.block_until_ready(start)
        t = time.perf_counter()
        out, _ = compiled(start, None)
        jax.block_until_ready(out)
        systolic_s = min(systolic_s, time.perf_counter() - t)
    if trace is not None:
        sys.path.insert(0, str(HARNESS))
        from tpu_profile import traced

        trace.mkdir(parents=True, exist_ok=True)
        traced(f"sim-jax-cfd-{n}", lambda: peer(peer_start), trace)
        again = jax.tree.map(lambda x: x.copy(), state)
        traced(f"sim-systolic-{n}", lambda: compiled(again, None), trace)
    w_systolic = vorticity_of_systolic(np.asarray(out.params["w_hat"]))
    w_peer = np.fft.irfft2(np.asarray(peer_out, np.complex128), s=(n, n))
    return {"n": n, "steps": steps, "dt": sim.dt, "viscosity": viscosity, "jax_cfd_steps_per_s": steps / peer_s,
            "systolic_steps_per_s": steps / systolic_s, "ratio": peer_s / systolic_s, "compile_s": compile_s,
            **agreement(w_systolic, w_peer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--steps", type=int, default=0, help="steps per size (0: 40 at 256^2, fewer for larger grids)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each, alternating; the best counts")
    parser.add_argument("--json", metavar="PATH", help="append one JSON object per size to PATH")
    parser.add_argument("--trace", metavar="DIR", type=Path, help="profile one more call of each side into DIR")
    args = parser.parse_args()
    import jax
    import jax_cfd

    from systolic.runtime import compile_cache

    compile_cache.enable()  # a second call on a warm machine skips the TPU compiler's minutes (tpu.sh sets it)

    print(f"{datetime.date.today()} | {jax.devices()[0].device_kind} | jax {jax.__version__}, jax-cfd "
          f"{jax_cfd.__version__} | float32, best of {args.repeats}, alternating")
    print("| grid | steps | jax-cfd steps/s | systolic steps/s | ratio | energy rel. diff | enstrophy rel. diff | "
          "max rel. vorticity diff |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        steps = args.steps or max(3, 40 * 256**2 // n**2)
        r = compare(n, steps, repeats=args.repeats, trace=args.trace)
        print(f"| {n}^2 | {steps} | {r['jax_cfd_steps_per_s']:.2f} | {r['systolic_steps_per_s']:.2f} | "
              f"{r['ratio']:.2f}x | {r['energy_rel_diff']:.1e} | {r['enstrophy_rel_diff']:.1e} | "
              f"{r['max_rel_diff']:.1e} |", flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps({"device": jax.devices()[0].device_kind, **r}) + "\n")


if __name__ == "__main__":
    main()
