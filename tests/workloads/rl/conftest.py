"""The tiny rl config (tests/tiny.py) as fixtures.

Every test that trains uses exactly these settings (plus run-length and mesh choices that do not change the
compiled program), so the session's persistent compile cache compiles each program once.
"""

import types

import jax
import pytest

from systolic import config as config_lib
from systolic.config import MeshConfig
from systolic.runtime import mesh as mesh_lib
from systolic.workloads.rl.config import RLConfig
from tiny import TINY_RL


def tiny_rl_config(*extra: str) -> RLConfig:
    return config_lib.from_dict(RLConfig, config_lib.apply_overrides({}, [*TINY_RL, *extra]))


def devices_mesh(n: int):
    return mesh_lib.make_mesh(MeshConfig(data=n, fsdp=1, tensor=1), jax.devices()[:n])


@pytest.fixture(scope="session")
def tiny_rl():
    """`tiny_rl.config(*overrides)`, `tiny_rl.mesh(n_devices)`, `tiny_rl.overrides` (for CLI runs)."""
    return types.SimpleNamespace(config=tiny_rl_config, mesh=devices_mesh, overrides=list(TINY_RL))
