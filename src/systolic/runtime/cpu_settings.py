"""Which CPU-only choices are on: one settings object, read once from the environment.

- `xla_flags`: XNNPACK's dot fusion in XLA_FLAGS for the workloads measured faster with it (runtime/cpu_tuning.py).
- `flatten`, `attention`, `barrier`, `grouped`: the lm model's CPU rewrites (workloads/lm/model/cpu.py), read at
  trace time.
- `malloc`: the host allocator setting (runtime/host_memory.py), for processes that run many steps of the workloads
  it measured faster for.

SYSTOLIC_XLA_CPU_FLAGS=off turns the XLA flags off. SYSTOLIC_CPU_TWEAKS switches the rewrites and the allocator
setting for ablations: `all` (the default), `none`, or comma-separated names. Reading the settings changes nothing;
`cpu_tuning.apply_at_start` applies them. Why each choice, and its measured effect: docs/benchmarks.md, "CPU tuning
choices".

Its own module, below both `cpu_tuning` (which applies the settings at start) and `host_memory` (which reads the
allocator's switch), so that neither has to import the other to know what is on.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

FLAGS_ENV = "SYSTOLIC_XLA_CPU_FLAGS"
TWEAKS_ENV = "SYSTOLIC_CPU_TWEAKS"


@dataclass(frozen=True)
class CpuTuning:
    """Which CPU-only choices are on (each applies only where the CPU is the compute platform)."""

    xla_flags: bool = True
    flatten: bool = True
    attention: bool = True
    barrier: bool = True
    grouped: bool = True
    malloc: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> CpuTuning:
        flags_on = environ.get(FLAGS_ENV, "").lower() not in ("off", "0", "false", "none")
        tweaks = environ.get(TWEAKS_ENV, "all").strip()
        names = {s.strip() for s in tweaks.split(",")}
        on = lambda name: tweaks == "all" or name in names  # noqa: E731
        return cls(xla_flags=flags_on, flatten=on("flatten"), attention=on("attention"), barrier=on("barrier"),
                   grouped=on("grouped"), malloc=on("malloc"))


@functools.cache
def settings() -> CpuTuning:
    """The process's CPU tuning, read from the environment on the first call. A test that changes
    SYSTOLIC_CPU_TWEAKS or SYSTOLIC_XLA_CPU_FLAGS calls `settings.cache_clear()` to have it read again."""
    return CpuTuning.from_env(os.environ)
