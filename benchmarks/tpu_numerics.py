"""Where the chip's float32 differs from the CPU's, in the operations the sim workload is made of: `exp` of the small
negative arguments of a viscous integrating factor exp(-nu k^2 dt / 2) (the platform's `jnp.exp` against the
solvers' own, time_stepping.exp), and the real FFT's round trip (its bias, not
only its error: a transform that shrinks every field by 1e-7 drains energy by 2e-7 a transform, steadily, where an
unbiased error of the same size averages out). Then the 64^2 turbulence run of tests/tpu/test_workload_parity.py
with each candidate in the factors (the CPU side with the solvers' own): energy on the default device against the
CPU's.

    python benchmarks/tpu_numerics.py          # on the lent chip: bash benchmarks/tpu.sh env python3 benchmarks/...

Errors are against float64 NumPy, in units of the float32 result's ulp (signed mean: the bias; max |.|: the error).
On a CPU-only machine both sides are the CPU (a check of the script itself)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from systolic.workloads.sim import time_stepping  # noqa: E402


def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Signed error of float32 `got` against float64 `want`, in ulps of float32 at `want`."""
    spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return (got.astype(np.float64) - want) / spacing


def exp_rows(device: jax.Device) -> list[str]:
    x = -np.logspace(-7, 0, 200_001).astype(np.float32)  # nu k^2 dt / 2 spans these for the recipes' grids
    want = np.exp(x.astype(np.float64))
    candidates = {
        "time_stepping.exp (the solvers')": time_stepping.exp,
        "jnp.exp": lambda v: jnp.exp(v),
        "1 + jnp.expm1": lambda v: 1 + jnp.expm1(v),
        "jnp.exp2(v * log2 e)": lambda v: jnp.exp2(v * np.float32(np.log2(np.e))),
    }
    rows = []
    for name, fn in candidates.items():
        got = np.asarray(jax.jit(fn)(jax.device_put(x, device)))
        err = ulps(got, want)
        small = np.abs(x) < 1e-3
        rows.append(f"| exp | {name} | {err.mean():+.3f} | {err[small].mean():+.3f} | {np.abs(err).max():.1f} |")
    return rows


def fft_rows(device: jax.Device, n: int, draws: int = 16) -> list[str]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((draws, n, n)).astype(np.float32)
    round_trip = jax.jit(lambda v: jnp.fft.irfft2(jnp.fft.rfft2(v), s=v.shape[-2:]))
    forward = jax.jit(lambda v: jnp.fft.rfft2(v))
    y = np.asarray(round_trip(jax.device_put(x, device))).astype(np.float64)
    xs = x.astype(np.float64)
    gain = (y * xs).sum(axis=(1, 2)) / (xs * xs).sum(axis=(1, 2)) - 1  # the part of y along x: the bias
    f = np.asarray(forward(jax.device_put(x, device))).astype(np.complex128)
    ref = np.fft.rfft2(xs)
    fgain = (np.real(np.conj(ref) * f)).sum(axis=(1, 2)) / (np.abs(ref) ** 2).sum(axis=(1, 2)) - 1
    ferr = np.abs(f - ref).max() / np.abs(ref).max()
    return [f"| rfft2 -> irfft2 {n}^2 | gain along x - 1 | {gain.mean():+.2e} | std {gain.std():.1e} | - |",
            f"| rfft2 {n}^2 | gain along NumPy's - 1 | {fgain.mean():+.2e} | std {fgain.std():.1e} | "
            f"max err {ferr:.1e} |"]


def turbulence_energy(device: jax.Device, exp, paired: bool | None = None) -> np.ndarray:
    """The parity test's run (64^2, float32, 5 frames of 10 steps of dt = 0.01) with `exp` in the solver's factors,
    the real transforms paired or not (None: the platform's choice): (frames, [energy, enstrophy])."""
    from systolic import config as config_lib
    from systolic.config import MeshConfig
    from systolic.runtime import mesh as mesh_lib
    from systolic.workloads.sim import solver
    from systolic.workloads.sim.config import SimConfig
    from systolic.workloads.sim.solver import make_simulation

    cfg, _ = config_lib.load(SimConfig, "sim-turbulence",
                             ["grid.n=64", "sim.dtype=float32", "sim.dt=0.01", "sim.t_end=0.5", "output.frames=5"],
                             "sim-turbulence")
    saved, time_stepping.exp = time_stepping.exp, exp
    choice = solver.pairs_real_transforms
    if paired is not None:
        solver.pairs_real_transforms = lambda mesh: paired
    try:
        with jax.default_device(device), jax.default_matmul_precision("highest"):
            sim = make_simulation(cfg, mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), [device]))
            state, rows = sim.initial_state(), []
            for _ in range(cfg.output.frames):
                state, metrics = sim.frame_step(state, None)
                rows.append([float(metrics["energy"]), float(metrics["enstrophy"])])
    finally:
        time_stepping.exp, solver.pairs_real_transforms = saved, choice
    return np.array(rows)


def main() -> None:
    chip, host = jax.devices()[0], jax.devices("cpu")[0]
    print(f"{chip.device_kind} against {host.device_kind}, jax {jax.__version__}")
    print("| operation | variant | signed mean (ulp or relative) | on |x| < 1e-3 / spread | max |")
    print("|---|---|---|---|---|")
    for line in exp_rows(chip) + exp_rows(host)[:1] + fft_rows(chip, 64) + fft_rows(chip, 1024) + fft_rows(host, 64):
        print(line)
    print("\n| 64^2 run: exp in the factors, transforms | energy at t=0.5 (this / CPU) - 1 | enstrophy "
          "| max over frames |")
    print("|---|---|---|---|")
    ours = time_stepping.exp
    on_host = turbulence_energy(host, ours)
    expm1 = lambda v: 1 + jnp.expm1(v)  # noqa: E731
    for name, exp, paired in [("time_stepping.exp, platform's choice", ours, None),
                              ("time_stepping.exp, unpaired", ours, False), ("time_stepping.exp, paired", ours, True),
                              ("jnp.exp, platform's choice", jnp.exp, None),
                              ("1 + jnp.expm1, platform's choice", expm1, None)]:
        got = turbulence_energy(chip, exp, paired)
        rel = got / on_host - 1
        print(f"| {name} | {rel[-1, 0]:+.2e} | {rel[-1, 1]:+.2e} | {np.abs(rel).max():.2e} |")


if __name__ == "__main__":
    main()
