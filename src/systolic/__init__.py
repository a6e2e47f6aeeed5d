"""systolic: one JAX training stack for language models, RL, GANs and scientific simulation.

Importing it sets one thing, and only on a host with no accelerator device files: JAX_PLATFORMS=cpu (unless the user
chose a platform), so that a script of one's own that imports systolic starts jax as quietly as the CLI does. Nothing
else changes (XLA_FLAGS included); the CLI applies the CPU tuning at start (runtime/cpu_tuning.py).
"""

import glob as _glob
import os as _os
import sys as _sys


def _cpu_on_a_host_without_accelerators() -> None:
    """With libtpu installed, jax probes for a TPU when it starts and prints libtpu's errors about not finding one
    (TPU_ACCELERATOR_TYPE, worker hostnames). Where jax was imported first it read the environment already, so its
    platform setting is made too: that acts until jax starts a backend, and after that changes nothing."""
    if "JAX_PLATFORMS" in _os.environ:
        return
    tpu = _glob.glob("/dev/accel*") or [p for p in _glob.glob("/dev/vfio/*") if not p.endswith("/vfio")]
    gpu = _glob.glob("/dev/nvidia[0-9]*") or _glob.glob("/dev/kfd")
    if tpu or gpu:
        return
    _os.environ["JAX_PLATFORMS"] = "cpu"
    jax = _sys.modules.get("jax")
    if jax is not None and jax.config.jax_platforms is None:  # None: the user's script chose no platform either
        jax.config.update("jax_platforms", "cpu")


_cpu_on_a_host_without_accelerators()
