"""Importing systolic on a host without accelerators starts jax on the CPU as quietly as the CLI does: a user's own
script prints none of libtpu's errors about a missing TPU (systolic/__init__.py)."""

import glob
import importlib.util
import os
import subprocess
import sys

import pytest

ACCELERATOR_FILES = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*") + glob.glob("/dev/nvidia[0-9]*")


@pytest.mark.skipif(bool(ACCELERATOR_FILES), reason="a host with accelerators keeps jax's own platform choice")
@pytest.mark.parametrize("first", ["systolic", "jax"])
def test_a_script_importing_systolic_prints_nothing_from_libtpu(first):
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: nothing would probe for a TPU")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # so libtpu gets as far as its warnings even while a test holds its lock
    second = "jax" if first == "systolic" else "systolic"
    code = f"import {first}, {second}, jax; print(jax.default_backend())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "cpu", proc.stderr
    assert "TPU" not in proc.stderr and "libtpu" not in proc.stderr, proc.stderr


@pytest.mark.skipif(bool(ACCELERATOR_FILES), reason="a host with accelerators keeps jax's own platform choice")
def test_the_users_platform_choice_stands():
    env = {**os.environ, "JAX_PLATFORMS": ""}
    code = "import os, systolic; print(repr(os.environ['JAX_PLATFORMS']))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "''", proc.stderr
