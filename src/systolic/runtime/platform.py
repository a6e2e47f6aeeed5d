"""Which platform the program being traced will run on, and which devices will compile it.

`device_platform()` is the platform of the current mesh's devices (compile-only TPU devices when a CPU host
compiles for a TPU topology), else this process's backend; it is safe inside jit, which keys its cache on the
abstract mesh. `compile_platform()` is what the program is written for: `systolic plan` for a GPU target traces GPU
code (bfloat16, no CPU rewrites) but compiles it with XLA:CPU on fake devices, and says so with `compiling_for`.
Model code that picks a platform-specific formulation (compute dtype, the CPU rewrites of workloads/lm/model/cpu.py)
asks `compile_platform()`; a kernel that only one compiler can build (splash: libtpu, cuDNN: CUDA) asks
`device_platform()`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("systolic_compile_platform", default=None)


def device_platform() -> str:
    """"tpu", "gpu" or "cpu": the platform of the devices the program being traced is compiled for."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def compile_platform() -> str:
    """"tpu", "gpu" or "cpu": the target of the program being traced now."""
    return _TARGET.get() or device_platform()


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Trace (and lower) for `platform` inside this block, whatever devices this process has."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)
