"""Which platform the program being traced will run on.

Usually the platform of this process's devices. `systolic plan` traces on a CPU host for a chip it does not
have, so it says so here, and model code that picks a platform-specific formulation (compute dtype, the CPU
rewrites of workloads/lm/cpu.py, a TPU attention kernel) asks `compile_platform()` rather than
`jax.default_backend()`. For a TPU target libtpu compiles the program, so TPU kernels may be used. A GPU target
is traced as GPU code but compiled by XLA:CPU (there is no CUDA compiler here): GPU-only kernels must still fall
back when `jax.default_backend()` is "cpu".
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("systolic_compile_platform", default=None)


def compile_platform() -> str:
    """"tpu", "gpu" or "cpu": the target of the program being traced now."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Trace (and lower) for `platform` inside this block, whatever devices this process has."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)
