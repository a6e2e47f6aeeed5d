"""Fixtures for the sim tests: 64-bit jax for one test only, configs from overrides, meshes by layout."""

import jax
import pytest

from systolic import config as config_lib
from systolic.config import MeshConfig
from systolic.runtime.mesh import make_mesh
from systolic.workloads.sim.config import SimConfig

# (data, fsdp, tensor). The 3-D solver's pencils are data x (fsdp * tensor): "data=8" is its 8x1 slab, "1x8" the
# other slab, "2x2x2" 2 x 4 pencils over all three axes.
LAYOUTS = {"1 device": (1, 1, 1), "data=8": (8, 1, 1), "2x2x2": (2, 2, 2), "2x2": (2, 2, 1), "2x4": (2, 4, 1),
           "1x8": (1, 8, 1)}


@pytest.fixture
def x64():
    """float64 for the verification tests, restored afterwards so it cannot leak into other tests."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


@pytest.fixture
def sim_config():
    """sim_config("grid.n=32", ..., recipe=None) -> a validated SimConfig (defaults, or a recipe, plus overrides)."""

    def make(*overrides: str, recipe: str | None = None) -> SimConfig:
        if recipe is None:
            return config_lib.from_dict(SimConfig, config_lib.apply_overrides({}, list(overrides)))
        return config_lib.load(SimConfig, recipe, list(overrides), recipe)[0]

    return make


@pytest.fixture
def mesh_of():
    """mesh_of("data=8") -> a (data, fsdp, tensor) mesh over the first devices, for a layout in LAYOUTS."""
    return lambda layout: make_mesh(MeshConfig(*LAYOUTS[layout]), devices=jax.devices()[: _size(layout)])


def _size(layout: str) -> int:
    data, fsdp, tensor = LAYOUTS[layout]
    return data * fsdp * tensor
