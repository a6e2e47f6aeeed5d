"""The sim workload as the CLI sees it: its record and `systolic simulate`, a recipe run like `systolic train`
whose workload is implied. Light: the functions are imported when a command runs."""

from __future__ import annotations

from systolic.commandline import Command, Lazy, run_arguments
from systolic.workloads import Workload
from systolic.workloads.sim.config import SimConfig

ENTRY = "systolic.workloads.sim.entry"

_SIMULATE = Command(
    "simulate", help="run a simulation (sim workload; default recipe sim-turbulence)",
    description="Run a PDE simulation from a recipe plus key=value overrides; pictures at the end.",
    args=run_arguments("grid.n=512 sim.t_end=2.0 mesh.data=8", "runs/<recipe>"),
    run=Lazy("systolic.cli.commands:run_recipe"), stepping=True)

WORKLOAD = Workload(name="sim", config=SimConfig, default_recipe="sim-turbulence",
                    commands={"simulate": Lazy(f"{ENTRY}:simulate"), "fit": Lazy(f"{ENTRY}:fit"),
                              "plan": Lazy(f"{ENTRY}:plan")},
                    own_commands=(_SIMULATE,))
