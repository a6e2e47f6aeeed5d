"""Every sim recipe loads and validates; bad values are refused with a fix."""

import pytest

from systolic import config as config_lib
from systolic.errors import ConfigError
from systolic.workloads.sim.config import SimConfig

RECIPES = ["sim-turbulence", "sim-taylor-green", "sim-gray-scott", "sim-viscosity-inverse", "sim-taylor-green-3d"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_load(recipe):
    cfg, name = config_lib.load(SimConfig, recipe, [], recipe)
    assert cfg.workload == "sim" and name == recipe
    assert config_lib.from_dict(SimConfig, config_lib.to_dict(cfg)) == cfg  # config.yaml round-trips


def test_issue_example_overrides():
    cfg, _ = config_lib.load(SimConfig, "sim-taylor-green", ["grid.n=512", "sim.t_end=2.0", "mesh.data=8"], "")
    assert (cfg.grid.n, cfg.sim.t_end, cfg.mesh.data, cfg.sim.solver) == (512, 2.0, 8, "spectral")
    assert cfg.frame_time == pytest.approx(0.1)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["grid.n=7"], "even number >= 8"),
        (["sim.cfl=2"], "0 < cfl <= 1"),
        (["sim.dtype=float16"], "Allowed values: float32, float64"),
        (["navier_stokes.viscosity=-1"], "viscosity >= 0"),
        (["output.frames=0"], "frames >= 1"),
        (["fit.initial_viscosity=0"], "initial_viscosity > 0"),
        (["navier_stokes_3d.velocity=0"], "velocity > 0"),
        (["sim.equation=navier_stokes_3d", "grid.n=16", "navier_stokes_3d.initial_wavenumber=6"],
         "not resolved on grid.n=16"),
    ],
)
def test_bad_values_are_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        config_lib.from_dict(SimConfig, config_lib.apply_overrides({}, overrides))


def test_the_3d_recipe_is_the_standard_benchmark():
    from systolic.workloads.sim.taylor_green import is_reference_case

    cfg, _ = config_lib.load(SimConfig, "sim-taylor-green-3d", [], "")
    assert (cfg.sim.dimensions, cfg.sim.solver, cfg.grid.n) == (3, "spectral pencils", 128)
    assert is_reference_case(cfg)  # Re = V / (k nu) = 1600 on [0, 2 pi)^3
    assert not is_reference_case(config_lib.load(SimConfig, "sim-taylor-green-3d", ["navier_stokes_3d.viscosity=1e-3"],
                                                 "")[0])
