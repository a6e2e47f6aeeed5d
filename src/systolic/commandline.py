"""A command as declared data: its arguments, its help, what runs it; and the argparse parsers built from it.

The engine's commands (cli/commands.py, cli/plan.py) and each workload's (workloads/*/commands.py) are
declared with these records, so the CLI builds its parser from them and dispatches without knowing any one of
them. A declaration names the function that runs it with `Lazy` ("module:name"), so building the parser (for
`systolic -h` or `systolic info`) imports no model code; the module is imported when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from systolic.errors import UserError


@dataclasses.dataclass(frozen=True)
class Lazy:
    """The function `module:name`, imported on its first call, so that declaring it costs no import."""

    target: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Arg:
    """One command-line argument, as `ArgumentParser.add_argument(*flags, **settings)` takes it."""

    flags: tuple[str, ...]
    settings: Mapping[str, Any]


def arg(*flags: str, **settings: Any) -> Arg:
    return Arg(flags, settings)


@dataclasses.dataclass(frozen=True)
class Command:
    """`systolic NAME`: `run(args) -> exit code` with the parsed arguments, or, for a group such as `convert`, its
    `subcommands` (chosen by a positional named `metavar`). What the process needs before it runs:
    - `stepping`: it runs many steps of one compiled function, so it gets the host allocator setting (faster
      steps, slower compilation; runtime/host_memory.py). Short commands are mostly compilation.
    - `compiles`: it may compile (the compile cache, and the compiled extensions imported before signals arm).
    - `platform(args)`: sets the JAX platform itself (plan: compile-only devices) instead of the host's.
    - `workload_options`: the workload it names declares its options (`Workload.options`); they are parsed after
      the workload, so `-h` is the workload's too (eval).
    """

    name: str
    help: str
    run: Callable[[argparse.Namespace], int] | None = None
    args: tuple[Arg, ...] = ()
    description: str | None = None
    usage: str | None = None
    subcommands: tuple[Command, ...] = ()
    metavar: str = "ACTION"
    stepping: bool = False
    compiles: bool = True
    platform: Callable[[argparse.Namespace], None] | None = None
    workload_options: bool = False

    @property
    def takes_overrides(self) -> bool:
        """Whether it takes KEY=VALUE overrides, which may sit between its options."""
        return any(a.flags == ("overrides",) for a in self.args)


def add_commands(sub: argparse._SubParsersAction, commands: Iterable[Command], workload: str | None = None) -> None:
    """Adds each command's parser to `sub`; the parsed arguments carry the command (`args.command`) and the
    workload it runs (`args.workload`: the one it names, `workload` for a workload's own command, else None)."""
    for command in commands:
        parser = sub.add_parser(command.name, help=command.help, description=command.description,
                                usage=command.usage, add_help=not command.workload_options)
        for a in command.args:
            parser.add_argument(*a.flags, **a.settings)
        if command.subcommands:
            add_commands(parser.add_subparsers(required=True, metavar=command.metavar), command.subcommands, workload)
        else:
            parser.set_defaults(command=command, workload=workload, print_help=parser.print_help)


def run_arguments(example: str, default_dir: str) -> tuple[Arg, ...]:
    """The arguments of every command that runs a recipe in a run directory: overrides, --recipe, --run-dir, -q,
    --debug, --no-jit."""
    return (
        arg("overrides", nargs="*", metavar="KEY=VALUE", help=f"config overrides, e.g. {example}"),
        arg("--recipe", help="bundled recipe name (`lm-sft`, or `sft` under `train lm`) or path to a YAML file "
            "(default: the workload's default)"),
        arg("--run-dir", type=Path, help=f"where the run writes everything (default: {default_dir})"),
        arg("-q", "--quiet", action="store_true", help="print nothing but errors"),
        arg("--debug", action="store_true", help="NaN/Inf checks, checkify on the train step (NaN, out-of-bounds "
            "index, division by zero) and JAX's recompilation reasons; slower"),
        arg("--no-jit", action="store_true", help="run eagerly (jax.disable_jit) so print and pdb work inside the "
            "step; much slower"),
    )


class OptionParser(argparse.ArgumentParser):
    """A workload command's own options: a parse error is a UserError (one paragraph, exit 2), not argparse's exit."""

    def error(self, message: str):
        raise UserError(f"`{self.prog}`: {message}. Usage: {self.usage_line()}. Fix: correct the arguments; "
                        f"`{self.prog} -h` describes each.")

    def usage_line(self) -> str:
        return " ".join(self.format_usage().split()).removeprefix("usage: ")
