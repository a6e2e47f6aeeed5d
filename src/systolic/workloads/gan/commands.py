"""The gan workload as the CLI sees it: its record, and `systolic sample gan` with its arguments. Light: the
functions are imported when a command runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from systolic import workloads
from systolic.commandline import Command, Lazy, arg
from systolic.workloads import Workload
from systolic.workloads.gan.config import GANConfig

ENTRY = "systolic.workloads.gan.entry"


def _sample(args: argparse.Namespace) -> int:
    sample = workloads.get(args.workload).command("sample")  # `systolic sample lm`: the error names gan
    print(sample(args.run_dir, count=args.count, out=args.out, seed=args.seed, force=args.force))
    return 0


_SAMPLE = Command(
    "sample", help="draw images from a trained gan run directory into a PNG grid", run=_sample,
    description="e.g. `systolic sample gan runs/gan-digits --count 64 --out grid.png`.",
    args=(arg("workload", help="which workload: gan"),
          arg("run_dir", type=Path),
          arg("--count", type=int, default=64, help="how many images (default 64)"),
          arg("--out", type=Path, help="PNG to write (default RUN_DIR/sample.png)"),
          arg("--seed", type=int, default=0),
          arg("--force", action="store_true", help="replace an existing --out file")))

WORKLOAD = Workload(name="gan", config=GANConfig, default_recipe="gan-digits",
                    commands={"train": Lazy(f"{ENTRY}:train"), "sample": Lazy(f"{ENTRY}:sample"),
                              "plan": Lazy(f"{ENTRY}:plan")},
                    own_commands=(_SAMPLE,))
