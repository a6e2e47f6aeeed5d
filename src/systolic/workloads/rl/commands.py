"""The rl workload as the CLI sees it: its record and the options of `systolic eval rl`. Light: the functions
are imported when a command runs."""

from __future__ import annotations

from pathlib import Path

from systolic.commandline import Lazy, arg
from systolic.workloads import Workload
from systolic.workloads.rl.config import RLConfig

ENTRY = "systolic.workloads.rl.entry"

# `systolic eval rl`'s own options (the arguments of entry.evaluate).
_EVAL_OPTIONS = (
    arg("--episodes", type=int, default=100, metavar="N", help="episodes per seed (default 100)"),
    arg("--gymnasium", action="store_true", help="run the policy in Gymnasium's reference implementation"),
    arg("--gif", type=Path, metavar="FILE.gif", help="also write a GIF of one episode to this path"),
    arg("--seed", type=int, default=0, metavar="N", help="seed of the evaluation episodes' start states"),
    arg("--force", action="store_true", help="replace an existing --gif file"))

WORKLOAD = Workload(name="rl", config=RLConfig, default_recipe="rl-cartpole",
                    commands={"train": Lazy(f"{ENTRY}:train"), "eval": Lazy(f"{ENTRY}:evaluate"),
                              "plan": Lazy(f"{ENTRY}:plan")},
                    options={"eval": _EVAL_OPTIONS})
