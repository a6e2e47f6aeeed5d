"""The workload protocol and registry.

A workload is a declared record, `Workload`: its config class, its default recipe, and the commands it offers,
each a plain function. The CLI dispatches from these records and never probes a module for what it might have.
Command signatures, by name (the CLI calls them so):

- `train`, `simulate`, `fit`: `(cfg, run_dir, quiet) -> engine.loop.RunResult`; they run the engine's loop.
- `eval`: `(run_dir, **options) -> str`, the report to print; `options` are the ones the workload declares in
  `options["eval"]` (rl: episodes, gymnasium, gif, seed; lm: data, choices, batch_size).
- `sample`: `(run_dir, *, count, out, seed) -> Path`, the picture written.
- `generate`: `(run_dir, prompt, max_new_tokens, temperature, top_k, top_p, seed, *, chat, system) -> str`;
  with `chat`, `prompt` is the user's message and the result the assistant's reply.
- `bench`: `(cfg) -> context manager yielding the engine Task`, timed by `systolic bench`.
- `plan`: `(cfg, devices) -> plan.planner.StepProgram`: the real step lowered on a mesh of `devices` (the plan
  target's), with the workload's FLOP formula (or None) and the FLOPs of custom kernels XLA cannot count;
  plan/planner.py compiles it and weights its loops by their trip counts. Every workload offers one.

`options` (optional) maps a command to a function that adds that command's own options to an argparse parser: the
CLI parses them per workload, so an option of another workload's command (`systolic eval lm --episodes`) is an
error, not ignored. `resolve_config(cfg, overrides, run_dir) -> cfg` (optional) completes a config from elsewhere before a run
(lm's `init.from=RUN_DIR`). A finished run is opened through `engine.rundir` (config, workload check, newest
intact checkpoint). Workload modules are imported lazily, so `systolic info` pays for no model code.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from systolic.errors import UserError

WORKLOADS = {"lm": "systolic.workloads.lm.entry", "sim": "systolic.workloads.sim.entry",
             "gan": "systolic.workloads.gan.entry", "rl": "systolic.workloads.rl.entry"}

# How each command is written on the command line, for the error that lists who offers it.
USAGE = {"train": "systolic train {w} --recipe RECIPE", "simulate": "systolic simulate --recipe RECIPE",
         "fit": "systolic fit {w} --recipe RECIPE", "eval": "systolic eval {w} RUN_DIR",
         "sample": "systolic sample {w} RUN_DIR --count 64 --out grid.png", "generate": "systolic generate RUN_DIR",
         "bench": "systolic bench {w} --recipe RECIPE", "plan": "systolic plan {w} --recipe RECIPE --target TARGET"}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    config: type  # the frozen dataclass schema of its recipes
    default_recipe: str
    commands: Mapping[str, Callable[..., Any]]  # command name -> function (signatures above)
    resolve_config: Callable[[Any, list[str], Any], Any] | None = None
    options: Mapping[str, Callable[[Any], None]] = dataclasses.field(default_factory=dict)  # command -> add its options

    def command(self, name: str) -> Callable[..., Any]:
        """The function for `name`, or a UserError naming the workloads that offer it."""
        if name in self.commands:
            return self.commands[name]
        able = [w for w in WORKLOADS if name in get(w).commands]
        example = USAGE.get(name, f"systolic {name} {{w}}").format(w=able[0]) if able else ""
        raise UserError(f"The '{self.name}' workload has no `{name}` command; the workloads that have one: "
                        f"{', '.join(able) or 'none'}. Fix: e.g. `{example}`.")


def get(name: str | None) -> Workload:
    if not isinstance(name, str) or name not in WORKLOADS:
        close = difflib.get_close_matches(str(name), list(WORKLOADS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise UserError(f"Unknown workload '{name}'.{hint} Available workloads: {', '.join(WORKLOADS)}.")
    return importlib.import_module(WORKLOADS[name]).WORKLOAD


def config_class(name: str | None) -> type:
    return get(name).config
