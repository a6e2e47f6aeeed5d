"""The workload registry: each workload module exposes `Config`, `DEFAULT_RECIPE` and `train(cfg, run_dir, quiet)`.

Workloads are imported lazily so `systolic info` does not pay for model code it does not use.
"""

from __future__ import annotations

import difflib
import importlib
from types import ModuleType

from systolic.errors import UserError

WORKLOADS = {"lm": "systolic.workloads.lm.entry", "sim": "systolic.workloads.sim.entry", "gan": "systolic.workloads.gan.entry",
             "rl": "systolic.workloads.rl.entry"}


def get(name: str | None) -> ModuleType:
    if name not in WORKLOADS:
        close = difflib.get_close_matches(str(name), list(WORKLOADS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise UserError(f"Unknown workload '{name}'.{hint} Available workloads: {', '.join(WORKLOADS)}.")
    return importlib.import_module(WORKLOADS[name])


def config_class(name: str | None) -> type:
    return get(name).Config
