"""JAX's persistent compilation cache, on by default: a second run of the same program skips XLA compilation.

Location: $SYSTOLIC_COMPILE_CACHE, else ~/.cache/systolic/xla; set SYSTOLIC_COMPILE_CACHE=off to disable.
Small programs are cached too (JAX's defaults skip anything that compiled in under a second, which is most of
a CPU run's start-up).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV = "SYSTOLIC_COMPILE_CACHE"


def enable() -> str | None:
    """Turns the cache on; returns its directory, or None when disabled."""
    setting = os.environ.get(ENV, "")
    if setting.lower() in ("off", "0", "false", "none"):
        return None
    path = Path(setting).expanduser() if setting else Path.home() / ".cache" / "systolic" / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(path)
