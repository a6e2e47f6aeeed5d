"""Host allocator settings for training on the CPU: keep XLA's per-step buffers mapped between steps.

XLA:CPU allocates each execution's temporaries as one block and frees it at the end of the step; glibc serves a
block that size with a fresh `mmap` and returns it with `munmap`, so every step page-faults the whole block in
again. `apply` tells glibc (through `mallopt`, so no environment variable has to be set before the process starts)
to serve large blocks from the heap and keep freed memory there: one arena, no `mmap` for large blocks, no
trimming. Two costs: the process keeps its peak host memory, and compilation is slower (XLA's compiler threads
contend for the one arena), so it is for processes that run many steps (`cpu_tuning.apply_at_start(stepping=True)`).
Figures: docs/benchmarks.md, "CPU tuning choices"; the mechanism: docs/design-notes.md, this module's section.

It applies only where the CPU is the compute platform (JAX_PLATFORMS says cpu, or no GPU/TPU plugin is
installed), only on glibc, and only when the tuning's `malloc` is on. It must run before JAX starts its thread
pools (the first computation), since a thread keeps the arena it started with; called later (the CLI's `main`
inside a test process, say) it does nothing, so the rest of that process keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

from systolic.runtime import cpu_settings

# glibc's <malloc.h>
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


def wanted(tuning: cpu_settings.CpuTuning) -> bool:
    """Whether the settings apply here (see the module docstring)."""
    if not tuning.malloc:
        return False
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0] == "cpu"
    return not any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_PLUGINS)


def _jax_started() -> bool:
    """Whether this process has already initialised a JAX backend (and with it XLA's thread pools)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge  # no public query; absent in some future jax, assume started

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def apply(tuning: cpu_settings.CpuTuning | None = None) -> bool:
    """Sets the glibc malloc options when `wanted` (by `tuning`, default the process's `cpu_settings.settings()`)
    and JAX has not started; returns whether they were set. Programs call `cpu_tuning.apply_at_start`."""
    if not wanted(tuning or cpu_settings.settings()) or _jax_started():
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, libc's among them
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # only glibc has mallopt's M_ARENA_MAX and these semantics
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; a refusal leaves glibc's defaults, which are correct, only slower.
    ok = mallopt(M_ARENA_MAX, 1) == 1
    ok &= mallopt(M_MMAP_MAX, 0) == 1
    ok &= mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return bool(ok)
