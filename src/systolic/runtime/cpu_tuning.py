"""The CPU tuning applied at start: the one call that applies every CPU-only choice (runtime/cpu_settings.py says
which are on), and XLA:CPU's optimisation level for run-once code.

- XLA flags: matmuls through XNNPACK (`XNN_DOT_FLAGS`) for the workloads that measure faster with them
  (`XNN_DOT_WORKLOADS`, empty on the current host). They are experimental and an unknown flag aborts XLA at
  start-up, so they are added only for jaxlib versions where they were checked (`VERIFIED_JAXLIB`), only when
  XLA_FLAGS does not already mention them (a user's XLA_FLAGS win), and never when SYSTOLIC_XLA_CPU_FLAGS=off.
- The host allocator setting (runtime/host_memory.py), for processes that run many steps of the workloads it
  measured faster for (`MALLOC_WORKLOADS`).
- `cpu_compiler_options` / `compile_once`: a lower XLA:CPU optimisation level for run-once or many-kernel code,
  where LLVM's optimisation costs more compile time than it saves.

Nothing happens at import: a library user's XLA_FLAGS stay theirs. The CLI calls `apply_at_start` before JAX
starts; a Python program that wants the CLI's speed calls it first thing. Why each choice, and its measured
effect: docs/benchmarks.md, "CPU tuning choices", and docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any, NamedTuple

from systolic.runtime import cpu_settings, host_memory

VERIFIED_JAXLIB = ("0.10.",)
XNN_DOT_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=", "--xla_cpu_experimental_xnn_fusion_type=dot")
# The workloads whose steps run faster with XNN_DOT_FLAGS on this project's CPU, each measured with and without them
# (benchmarks/studies/xla_flags_per_workload.py; figures in docs/benchmarks.md, "CPU tuning choices").
XNN_DOT_WORKLOADS: frozenset[str] = frozenset()  # re-measure on a new host: the benchmark, docs/benchmarks.md
# The workloads whose steps run faster with the host allocator setting (same benchmark, `--setting malloc`).
MALLOC_WORKLOADS = frozenset({"lm"})


class Applied(NamedTuple):
    xla_flags: bool  # XNN_DOT_FLAGS were added to XLA_FLAGS
    malloc: bool  # the host allocator setting was made


def apply_at_start(*, workload: str | None, stepping: bool, tuning: cpu_settings.CpuTuning | None = None) -> Applied:
    """Adds `workload`'s XLA:CPU flags to XLA_FLAGS and, for a process that runs many steps (`stepping`) of a
    workload in MALLOC_WORKLOADS, sets the host allocator, each where allowed (module docstring). `workload` None (a command that runs no workload): no
    flags. Call before JAX creates its backend: XLA reads XLA_FLAGS once, and a thread keeps the malloc arena it
    started with."""
    tuning = tuning or cpu_settings.settings()
    return Applied(xla_flags=_add_xla_flags(tuning, workload), malloc=stepping and workload in MALLOC_WORKLOADS and host_memory.apply(tuning))


def _add_xla_flags(tuning: cpu_settings.CpuTuning, workload: str | None) -> bool:
    if not tuning.xla_flags or workload not in XNN_DOT_WORKLOADS:
        return False
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return False
    current = os.environ.get("XLA_FLAGS", "")
    if not version.startswith(VERIFIED_JAXLIB) or "xnn_fusion_type" in current or "ynn_fusion_type" in current:
        return False
    os.environ["XLA_FLAGS"] = " ".join([current, *XNN_DOT_FLAGS]).strip()
    return True


def cpu_compiler_options(level: int) -> dict[str, int] | None:
    """`compiler_options` that set XLA:CPU's optimisation level; None (the default) on other backends."""
    import jax  # here, not at the top: this module is imported before JAX may start

    return {"xla_backend_optimization_level": level} if jax.default_backend() == "cpu" else None


def compile_once(fn: Any, *args: Any) -> Any:
    """Lowers and compiles a jitted run-once function (an init) at optimisation level 0 on CPU."""
    import jax

    if jax.config.jax_disable_jit:  # --no-jit: there is nothing to compile; the function runs eagerly
        return fn
    return fn.lower(*args).compile(compiler_options=cpu_compiler_options(0) or {})
