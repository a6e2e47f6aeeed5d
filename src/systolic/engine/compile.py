"""Compiler options for the CPU backend, shared by every workload.

XLA:CPU spends most of its compile time in LLVM optimisation, which buys little for code that runs once
(random initialisation) or is made of many small kernels. Measured on this project's 2-core CPU (jax 0.10.2):
the lm tiny model's train-state init compiled in 13.0 s at the default level and 1.9 s at level 0; rl's
training chunk in 20 s at level 2 and 12 s at level 1, running as fast. On GPU/TPU nothing changes.
"""

from __future__ import annotations

from typing import Any

import jax


def cpu_compiler_options(level: int) -> dict[str, int] | None:
    """`compiler_options` that set XLA:CPU's optimisation level; None (the default) on other backends."""
    return {"xla_backend_optimization_level": level} if jax.default_backend() == "cpu" else None


def compile_once(fn: Any, *args: Any) -> Any:
    """Lowers and compiles a jitted run-once function (an init) at optimisation level 0 on CPU."""
    if jax.config.jax_disable_jit:  # --no-jit: there is nothing to compile; the function runs eagerly
        return fn
    return fn.lower(*args).compile(compiler_options=cpu_compiler_options(0) or {})
