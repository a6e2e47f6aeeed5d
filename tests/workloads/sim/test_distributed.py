"""1 device against 8 (two layouts) in float64, and the communication each solver compiles to."""

import jax
import numpy as np
import pytest

from systolic.workloads.sim.solver import make_simulation

pytestmark = pytest.mark.usefixtures("x64")

CASES = {
    # Forced turbulence with CFL-chosen steps: the step count itself depends on a cross-device max.
    "navier_stokes": ("grid.n=32", "sim.t_end=0.3", "output.frames=2", "navier_stokes.viscosity=1e-3",
                      "navier_stokes.initial_wavenumber=3", "navier_stokes.forcing=kolmogorov"),
    "gray_scott": ("sim.equation=gray_scott", "grid.n=32", "grid.length=2.5", "sim.t_end=200", "output.frames=2"),
}

# What each solver's compiled frame may and may not contain on 8 devices. The slab transposes are the spectral
# solver's only grid-sized communication; an all-gather would mean XLA replicated a global FFT instead.
COLLECTIVES = {"navier_stokes": ("all-to-all", "all-gather"), "gray_scott": ("collective-permute", "all-to-all")}


def run_frames(cfg, mesh, *, check_hlo=None):
    sim = make_simulation(cfg, mesh)
    state = sim.initial_state()
    step = sim.frame_step
    if check_hlo:
        step = sim.frame_step.lower(state, None).compile()
        hlo = step.as_text()
        wanted, unwanted = check_hlo
        assert wanted in hlo and unwanted not in hlo and "all-gather" not in hlo
    for _ in range(cfg.output.frames):
        state, metrics = step(state, None)
    if not check_hlo:
        assert sim.frame_step._cache_size() == 1  # the second frame reused the first one's compilation
    return {k: np.asarray(v) for k, v in state.params.items()}, jax.device_get(metrics)


@pytest.mark.parametrize("equation", list(CASES))
def test_one_device_and_eight_agree_to_1e_12(equation, sim_config, mesh_of):
    cfg = sim_config(*CASES[equation], "sim.dtype=float64")
    reference, ref_metrics = run_frames(cfg, mesh_of("1 device"))
    for layout in ("data=8", "2x2x2"):
        check = COLLECTIVES[equation] if layout == "data=8" else None
        fields, metrics = run_frames(cfg, mesh_of(layout), check_hlo=check)
        assert metrics["steps"] == ref_metrics["steps"]
        for name, ref in reference.items():
            assert np.max(np.abs(fields[name] - ref)) <= 1e-12 * np.max(np.abs(ref)), (layout, name)
