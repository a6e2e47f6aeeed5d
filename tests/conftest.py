"""Test setup: 8 fake CPU devices so every sharding layout is tested on one machine.

XLA reads XLA_FLAGS once, when jax initialises its backend, so this must run before anything imports jax.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    platform = jax.default_backend()
    for item in items:
        if "gpu" in item.keywords and platform != "gpu":
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))
        if "tpu" in item.keywords and platform != "tpu":
            item.add_marker(pytest.mark.skip(reason="needs a TPU"))
