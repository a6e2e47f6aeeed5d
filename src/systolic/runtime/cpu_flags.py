"""XLA:CPU flags systolic sets by default: matmuls through XNNPACK instead of XLA's in-graph kernels.

Measured on this project's 2-core x86-64 CPU (benchmarks/lm_vs_pytorch.py, docs/benchmarks.md): the 6-layer,
384-wide GPT trained 8-15% faster (two runs) with `--xla_cpu_experimental_xnn_fusion_type=dot` (and the YNNPACK fusion
off). The flags only configure the CPU compiler, so GPU/TPU programs are unaffected. They are experimental
XLA flags and an unknown flag aborts XLA at start-up, so they are added only for jaxlib versions where they
were checked (`VERIFIED`), only when XLA_FLAGS does not already mention them, and never when
SYSTOLIC_XLA_CPU_FLAGS=off. Must run before JAX creates its CPU client (systolic's import does it).

`tweak_on` reads SYSTOLIC_CPU_TWEAKS, which switches systolic's other CPU-only choices for ablations: `all` (the
default), `none`, or comma-separated names of `flatten`, `attention`, `barrier` (the lm model's rewrites,
workloads/lm/cpu.py) and `malloc` (the host allocator setting, runtime/host_memory.py).
"""

from __future__ import annotations

import os
from importlib import metadata

VERIFIED = ("0.10.",)
FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=", "--xla_cpu_experimental_xnn_fusion_type=dot")
ENV = "SYSTOLIC_XLA_CPU_FLAGS"
TWEAKS_ENV = "SYSTOLIC_CPU_TWEAKS"


def apply() -> bool:
    """Adds FLAGS to XLA_FLAGS when allowed (see the module docstring); returns whether it did."""
    if os.environ.get(ENV, "").lower() in ("off", "0", "false", "none"):
        return False
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return False
    current = os.environ.get("XLA_FLAGS", "")
    if not version.startswith(VERIFIED) or "xnn_fusion_type" in current or "ynn_fusion_type" in current:
        return False
    os.environ["XLA_FLAGS"] = " ".join([current, *FLAGS]).strip()
    return True


def tweak_on(name: str) -> bool:
    """Whether SYSTOLIC_CPU_TWEAKS leaves the CPU-only choice `name` on (the platform is the caller's check)."""
    setting = os.environ.get(TWEAKS_ENV, "all").strip()
    return setting == "all" or name in {s.strip() for s in setting.split(",")}
