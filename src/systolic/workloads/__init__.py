"""The workload protocol and registry.

A workload is a declared record, `Workload`, in its light `commands.py`: its config class, its default recipe,
the functions it offers by command name, and the commands only it has. The CLI builds its parser from these
records and dispatches; it never probes a module for what it might have. Function signatures, by command name:

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
- `plan_serve`: `(cfg, devices, *, weights, kv, page_size) -> plan.serve.ServeModel`: the inference step lowered for
  `systolic plan WORKLOAD --serve` (lm).

`options` (optional) maps a command to its own options (`command.Arg`): the CLI parses them per workload, so an
option of another workload's command (`systolic eval lm --episodes`) is an error, not ignored. `own_commands` are
the commands only this workload has (lm: generate, export, convert, tokenizer; sim: simulate; gan: sample),
declared whole: arguments, help and what runs them. `resolve_config(cfg, overrides, run_dir) -> cfg` (optional)
completes a config from elsewhere before a run (lm's `init.from=RUN_DIR`). A finished run is opened through
`engine.finished` (config, workload check, newest intact checkpoint). The functions are `command.Lazy`
references, so `systolic info` and `systolic -h` import no model code.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from systolic.command import Arg, Command
from systolic.errors import UserError

WORKLOADS = {"lm": "systolic.workloads.lm.commands", "sim": "systolic.workloads.sim.commands",
             "gan": "systolic.workloads.gan.commands", "rl": "systolic.workloads.rl.commands"}

# How each command is written on the command line, for the error that lists who offers it.
USAGE = {"train": "systolic train {w} --recipe RECIPE", "fit": "systolic fit {w} --recipe RECIPE",
         "eval": "systolic eval {w} RUN_DIR", "sample": "systolic sample {w} RUN_DIR --count 64 --out grid.png",
         "bench": "systolic bench {w} --recipe RECIPE", "plan": "systolic plan {w} --recipe RECIPE --target TARGET",
         "plan_serve": "systolic plan {w} --serve --recipe RECIPE --target TARGET"}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    config: type  # the frozen dataclass schema of its recipes
    default_recipe: str
    commands: Mapping[str, Callable[..., Any]]  # command name -> function (signatures above)
    resolve_config: Callable[[Any, list[str], Any], Any] | None = None
    options: Mapping[str, tuple[Arg, ...]] = dataclasses.field(default_factory=dict)  # command -> its own options
    own_commands: tuple[Command, ...] = ()

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
