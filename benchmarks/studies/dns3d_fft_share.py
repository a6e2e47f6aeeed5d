"""The 3-D Taylor-Green DNS step on one device: steps/s, and how much of the step its FFTs take against the memory
roofline.

    python benchmarks/studies/dns3d_fft_share.py                                # 128^3 and 256^3, float32
    python benchmarks/studies/dns3d_fft_share.py --sizes 32 64 --steps 4        # a quick look on a CPU
    python benchmarks/studies/dns3d_fft_share.py --sizes 64 --bandwidth-gbs 20  # a roofline for a CPU: its own figure

systolic's solver (workloads/sim/navier_stokes_3d.py, the sim-taylor-green-3d recipe's problem: Re = 1600, float32)
runs a frame of `--steps` fixed steps of dt = 0.5 dx as one compiled program, timed as run. Then a second program
does only the transforms that those steps do: each RK4 stage of the step (4 a step) takes one batched inverse real
3-D FFT of six fields (u and w = curl u, (6, n, n, n/2 + 1) complex -> (6, n, n, n) real) and one batched forward
FFT of three (u x w, (3, n, n, n) -> (3, n, n, n/2 + 1)), through the solver's own `Pencil.inverse`/`forward`
(the same padding of the dropped Nyquist plane, the same slicing). The script reads the transforms of both
programs from their jaxprs and stops if they differ in kind, length, shape or count, so a change to the solver
cannot leave this program measuring something else. Between the two transforms of a stage the FFT program only
writes the forward result back into three of the six input fields (its loop's data dependence).

FFT share = the FFT program's time / the step's. The FFT roofline: every transform must read its input and write
its output at least once, so (their bytes) / (memory bandwidth) is the least time the FFTs can take; "of roofline"
is that least time over the measured FFT time (1 = at the memory bound). The bandwidth is the chip's HBM figure from
plan/targets.py (v5e: 819 GB/s, the data sheet) for a known accelerator, `--bandwidth-gbs` otherwise (else "n/a").
Last, XLA's own count per step: the compiled frame's flops and bytes accessed with every loop weighted by its trips
(plan/hlo_text.py `step_cost`, as `systolic plan` counts them: XLA's `cost_analysis()` counts a loop's body once),
over the frame's steps; its bytes are an upper estimate (every operand counted as read in full). Each program is
compiled before timing; the two alternate `--repeats` times, best time each.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import sys
import time

TG_VISCOSITY = 1 / 1600  # Re = 1600 for U = L = 1 (the recipe's 6.25e-4)


def systolic_simulation(n: int, dt: float, steps: int):
    """systolic's 3-D solver on one device, float32, the recipe's Taylor-Green flow; one frame = `steps` fixed steps."""
    import jax

    from systolic import config as config_lib
    from systolic.config import MeshConfig
    from systolic.runtime.mesh import make_mesh
    from systolic.workloads.sim.config import SimConfig
    from systolic.workloads.sim.solver import make_simulation

    overrides = ["sim.equation=navier_stokes_3d", f"grid.n={n}", f"sim.dt={dt}", f"sim.t_end={dt * steps}",
                 "output.frames=1", "sim.dtype=float32", f"navier_stokes_3d.viscosity={TG_VISCOSITY}",
                 "navier_stokes_3d.initial=taylor_green"]
    cfg = config_lib.from_dict(SimConfig, config_lib.apply_overrides({}, overrides))
    return make_simulation(cfg, make_mesh(MeshConfig(data=1), devices=jax.devices()[:1]))


def fft_program(n: int, steps: int):
    """The step's transforms alone: a loop of `steps` x 4 stages of (inverse of 6 fields, forward of 3), on a carried
    (6, n, n, n/2) spectrum (donated, so the write-back is in place)."""
    import jax
    from jax import lax

    from systolic.workloads.sim.pencil import Pencil

    pencil = Pencil(n)  # one device: plain rfftn / irfftn, as the solver's on one device

    def stage(spectrum):  # (6, n, n, n/2) complex
        physical = pencil.inverse(spectrum)  # (6, n, n, n) real: u and w
        return spectrum.at[:3].set(pencil.forward(physical[:3]))  # (3, n, n, n/2): u x w's transform, in place

    def step(spectrum, _):
        for _ in range(4):  # Lawson RK4: four evaluations of the nonlinear term (time_stepping.ifrk4_step)
            spectrum = stage(spectrum)
        return spectrum, None

    return jax.jit(lambda spectrum: lax.scan(step, spectrum, length=steps)[0], donate_argnums=0)


def transforms(fn, *args) -> list[tuple]:
    """Every FFT in `fn`'s jaxpr: (type, lengths, input shape, input dtype, output shape, output dtype, times run),
    a loop's transforms counted once per iteration."""
    import jax
    from jax.extend import core

    found = []

    def walk(jaxpr, times):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "fft":
                (x,), (y,) = eqn.invars, eqn.outvars
                found.append((eqn.params["fft_type"].name, tuple(eqn.params["fft_lengths"]), x.aval.shape,
                              str(x.aval.dtype), y.aval.shape, str(y.aval.dtype), times))
            inner = times * eqn.params["length"] if eqn.primitive.name == "scan" else times
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, (core.ClosedJaxpr, core.Jaxpr)):
                        walk(sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub, inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr, 1)
    return sorted(found)


def transform_bytes(found: list[tuple]) -> int:
    """The least memory traffic of these transforms: each input read once, each output written once."""
    import numpy as np

    return sum(times * (math.prod(x) * np.dtype(x_dtype).itemsize + math.prod(y) * np.dtype(y_dtype).itemsize)
               for _, _, x, x_dtype, y, y_dtype, times in found)


def device_bandwidth(flag_gbs: float | None) -> tuple[float | None, str]:
    """Bytes/s of the device's memory and where the figure comes from: the flag, else plan/targets.py's chip whose
    name is JAX's device_kind (TPU v5e: 'TPU v5 lite'), else None."""
    import jax

    from systolic.plan.targets import CHIPS

    if flag_gbs:
        return flag_gbs * 1e9, "--bandwidth-gbs"
    kind = jax.devices()[0].device_kind
    for name, chip in CHIPS.items():
        if chip.name == kind:
            return chip.hbm_bytes_per_s, f"plan/targets.py {name} HBM"
    return None, f"n/a for {kind!r} (pass --bandwidth-gbs)"


def xla_cost(compiled, steps: int) -> dict[str, float | None]:
    """XLA's flops and bytes accessed per step of a compiled frame of `steps` steps, loops weighted by their trips;
    None (with the reason on stderr) where the program's HLO cannot be costed."""
    from systolic.plan import hlo_text

    try:
        cost = hlo_text.step_cost(compiled.as_text())
    except Exception as e:  # noqa: BLE001 - the cost is a side figure: the timings stand without it
        print(f"dns3d_fft_share: no XLA cost analysis ({type(e).__name__}: {e}); the table says n/a", file=sys.stderr)
        return {"xla_flops_per_step": None, "xla_bytes_per_step": None}
    if cost.unknown:
        print(f"dns3d_fft_share: loops {', '.join(cost.unknown)} have no readable trip count and count once",
              file=sys.stderr)
    return {"xla_flops_per_step": cost.flops / steps, "xla_bytes_per_step": cost.bytes_accessed / steps}


def measure(n: int, steps: int, repeats: int = 3, bandwidth: float | None = None) -> dict:
    """Times a frame of `steps` DNS steps and the FFT program of the same transforms, alternating, best of
    `repeats` each; returns the times, the FFT share and the roofline figures."""
    import jax
    import jax.numpy as jnp

    dt = 0.5 * (2 * math.pi / n)  # CFL 0.5 for Taylor-Green's initial max(|u| + |v| + |w|) = 1
    sim = systolic_simulation(n, dt, steps)
    state = sim.initial_state()
    spectrum = jnp.concatenate([state.params["u_hat"]] * 2)  # (6, n, n, n/2): any finite field costs the same
    ffts = fft_program(n, steps)
    step_ffts, program_ffts = transforms(sim.frame_step, state, None), transforms(ffts, spectrum)
    if step_ffts != program_ffts:
        raise SystemExit(f"dns3d_fft_share: the FFT program no longer does the step's transforms.\n  step:    "
                         f"{step_ffts}\n  program: {program_ffts}\nFix: update fft_program() to the solver's "
                         "nonlinear term (workloads/sim/navier_stokes_3d.py).")
    t = time.perf_counter()
    # Both at once: the TPU compiler takes minutes for each on one core (68 s for the 128^3 FFT program, libtpu on
    # this project's 2-core host, 2026-12-06), and the chip's host has 13.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        step_job = pool.submit(lambda: sim.frame_step.lower(state, None).compile())
        fft_compiled, step_compiled = ffts.lower(spectrum).compile(), step_job.result()
    compile_s = time.perf_counter() - t

    step_s = fft_s = math.inf
    for _ in range(repeats):
        start = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))  # the frame step donates its input
        t = time.perf_counter()
        jax.block_until_ready(step_compiled(start, None))
        step_s = min(step_s, time.perf_counter() - t)

        carry = jax.block_until_ready(spectrum.copy())
        t = time.perf_counter()
        jax.block_until_ready(fft_compiled(carry))
        fft_s = min(fft_s, time.perf_counter() - t)
    fft_bytes = transform_bytes(step_ffts) / steps
    fields = sum(times * math.prod(x[:-len(lengths)]) for _, lengths, x, *_, times in step_ffts)  # a batch of 6 is 6
    least_s = fft_bytes / bandwidth if bandwidth else None
    return {"n": n, "steps": steps, "step_ms": 1e3 * step_s / steps, "steps_per_s": steps / step_s,
            "fft_ms_per_step": 1e3 * fft_s / steps, "fft_share": fft_s / step_s,
            "ffts_per_step": fields // steps,
            "fft_bytes_per_step": fft_bytes,
            "fft_gb_per_s": fft_bytes * steps / fft_s / 1e9, "bandwidth_bytes_per_s": bandwidth,
            "fft_roofline_ms_per_step": None if least_s is None else 1e3 * least_s,
            "fft_of_roofline": None if least_s is None else least_s / (fft_s / steps),
            "compile_s": compile_s, **xla_cost(step_compiled, steps)}


def _cell(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--steps", type=int, default=0, help="steps per frame (0: 20 at 128^3, scaled by 1/n^3, >= 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each, alternating; the best counts")
    parser.add_argument("--bandwidth-gbs", type=float, help="the device's memory bandwidth in GB/s (default: the "
                        "chip's HBM figure from plan/targets.py for a known accelerator, else n/a)")
    parser.add_argument("--json", metavar="PATH", help="append one JSON object per size to PATH")
    args = parser.parse_args()
    import jax

    from systolic.runtime import compile_cache, cpu_tuning

    compile_cache.enable()  # a second call on a warm machine skips the TPU compiler's minutes (tpu.sh sets it)
    cpu_tuning.apply_at_start(workload="sim", stepping=True)  # what `systolic simulate` runs with (on a CPU)
    bandwidth, source = device_bandwidth(args.bandwidth_gbs)
    kind = jax.devices()[0].device_kind
    memory = f"bandwidth {bandwidth / 1e9:.0f} GB/s ({source})" if bandwidth else f"bandwidth {source}"
    print(f"{datetime.date.today()} | {kind} | jax {jax.__version__} | float32, best of {args.repeats}, alternating | "
          f"{memory}")
    # 3-D FFTs/step: single-field real transforms (a batched call of six counts six).
    print("| grid | steps | ms/step | steps/s | FFT ms/step | FFT share | 3-D FFTs/step | FFT GB/step | FFT GB/s | "
          "FFT roofline ms/step | FFT of roofline | XLA GFLOP/step | XLA GB/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        steps = args.steps or max(2, round(20 * (128 / n) ** 3))
        r = measure(n, steps, args.repeats, bandwidth)
        print(f"| {n}^3 | {steps} | {r['step_ms']:.2f} | {r['steps_per_s']:.2f} | {r['fft_ms_per_step']:.2f} | "
              f"{100 * r['fft_share']:.0f}% | {r['ffts_per_step']} | {r['fft_bytes_per_step'] / 1e9:.3f} | "
              f"{r['fft_gb_per_s']:.1f} | {_cell(r['fft_roofline_ms_per_step'], '.2f')} | "
              f"{_cell(r['fft_of_roofline'], '.1%')} | "
              f"{_cell(r['xla_flops_per_step'] and r['xla_flops_per_step'] / 1e9, '.1f')} | "
              f"{_cell(r['xla_bytes_per_step'] and r['xla_bytes_per_step'] / 1e9, '.3f')} |", flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps({"device": kind, **r}) + "\n")


if __name__ == "__main__":
    main()
