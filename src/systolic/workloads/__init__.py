"""The workload protocol and registry.

A workload is a declared record, `Workload`, in its light `commands.py`: its config class, its default recipe,
the functions it offers by command name, and the commands only it has. The CLI builds its parser from these
records and dispatches; it never probes a module for what it might have. The functions are `command.Lazy`
references, so `systolic info` and `systolic -h` import no model code. Signatures, by command name:
`train`, `simulate`, `fit`: `(cfg, run_dir, quiet) -> engine.loop.RunResult`; `eval`: `(run_dir, **options) -> str`;
`sample`: `(run_dir, *, count, out, seed) -> Path`; `generate`:
`(run_dir, prompt, max_new_tokens, temperature, top_k, top_p, seed, *, chat, system) -> str`;
`bench`: `(cfg) -> context manager yielding the engine Task`; `plan`: `(cfg, devices) -> plan.planner.StepProgram`
(every workload offers one); `plan_serve`: `(cfg, devices, *, weights, kv, page_size) -> plan.serving.ServeModel`.

`options` maps a command to its own options, parsed per workload, so another workload's option is an error, not
ignored. A finished run is opened through `engine.finished`. What each function returns and each optional field
(`own_commands`, `plan_search`, `resolve_config`) does: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from systolic.commandline import Arg, Command
from systolic.errors import UserError

WORKLOADS = {"lm": "systolic.workloads.lm.commands", "sim": "systolic.workloads.sim.commands",
             "gan": "systolic.workloads.gan.commands", "rl": "systolic.workloads.rl.commands"}

# How each command is written on the command line, for the error that lists who offers it.
USAGE = {"train": "systolic train {w} --recipe RECIPE", "fit": "systolic fit {w} --recipe RECIPE",
         "eval": "systolic eval {w} RUN_DIR", "sample": "systolic sample {w} RUN_DIR --count 64 --out grid.png",
         "bench": "systolic bench {w} --recipe RECIPE", "plan": "systolic plan {w} --recipe RECIPE --target TARGET",
         "plan_serve": "systolic plan {w} --serve --recipe RECIPE --target TARGET"}


@dataclasses.dataclass(frozen=True)
class PlanSearch:
    """What `systolic plan --search` varies for a workload, besides the batch: its rematerialisation policies, most
    memory first (each saves less than the one before, so fits at least its batch), and how a config takes one."""

    remats: tuple[str, ...]
    configure: Callable[[Any, str, int], Any]  # (cfg, remat, global batch) -> the config to plan


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    config: type  # the frozen dataclass schema of its recipes
    default_recipe: str
    commands: Mapping[str, Callable[..., Any]]  # command name -> function (signatures above)
    resolve_config: Callable[[Any, list[str], Any], Any] | None = None
    options: Mapping[str, tuple[Arg, ...]] = dataclasses.field(default_factory=dict)  # command -> its own options
    own_commands: tuple[Command, ...] = ()
    plan_search: PlanSearch | None = None  # None: `systolic plan --search` does not apply

    def command(self, name: str) -> Callable[..., Any]:
        """The function for `name`, or a UserError naming the workloads that offer it."""
        if name in self.commands:
            return self.commands[name]
        able = offering(name)
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


def offering(command: str) -> list[str]:
    """The workloads that offer `command`, in registry order."""
    return [name for name in WORKLOADS if command in get(name).commands]


def argument(command: str, **settings: Any) -> Arg:
    """The WORKLOAD positional of a command that names its workload (`systolic train lm`); its help lists the
    workloads that offer the command."""
    able = offering(command)
    listed = f"{', '.join(able[:-1])} or {able[-1]}" if len(able) > 1 else able[0]
    return Arg(("workload",), {"help": f"which workload: {listed}", **settings})
