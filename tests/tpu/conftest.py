"""The `tpu` tests: the chip (JAX's default device when tests/conftest.py lets JAX see it: SYSTOLIC_TEST_PLATFORMS=
tpu,cpu, as `benchmarks/harness/tpu.sh test` sets) against the host's CPU in the same process. Under
SYSTOLIC_TEST_TPU_ON_CPU=1 the first CPU device stands in for the chip: a check of the tests themselves, where
every comparison holds trivially or nearly so."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import systolic
from systolic.config import MeshConfig
from systolic.runtime import mesh as mesh_lib

SRC = str(Path(systolic.__file__).parents[1])


@pytest.fixture(scope="session")
def chip() -> jax.Device:
    return jax.devices()[0]


@pytest.fixture(scope="session")
def host() -> jax.Device:
    return jax.devices("cpu")[0]


@pytest.fixture(scope="session")
def one_device_mesh():
    """device -> a mesh of that one device."""
    return lambda device: mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), [device])


@pytest.fixture(scope="session")
def on_cpu():
    """`python ARGV` in a process of its own on the CPU (JAX_PLATFORMS=cpu: the chip stays this process's), with
    this tree's src/ first."""

    def run(*argv: str) -> subprocess.CompletedProcess:
        path = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
        # Standard dtype promotion, as users run (tests/tpu/test_checkpoints.py says why).
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path, JAX_NUMPY_DTYPE_PROMOTION="standard")
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
        return proc

    return run
