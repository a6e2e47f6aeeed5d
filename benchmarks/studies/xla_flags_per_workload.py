"""Does each CPU setting help each workload? Each workload's real CLI run, with and without the setting.

    python benchmarks/studies/xla_flags_per_workload.py        # the XNNPACK dot flag; lm, rl, gan, sim; 3 rounds
    python benchmarks/studies/xla_flags_per_workload.py --workloads rl --rounds 5
    python benchmarks/studies/xla_flags_per_workload.py --setting malloc    # the host allocator setting

`--setting xnn` (the default), the XLA:CPU XNNPACK dot flag: "with": XLA_FLAGS carries `cpu_tuning.XNN_DOT_FLAGS`
(a user's XLA_FLAGS win, so the CLI keeps them whatever it would choose); "without": SYSTOLIC_XLA_CPU_FLAGS=off.
`--setting malloc`, the host allocator setting of runtime/host_memory.py (one arena, no mmap, no trimming): "with":
glibc's environment variables for the same three values (so the run has them whatever the CLI would choose);
"without": SYSTOLIC_CPU_TWEAKS names every tweak but `malloc`. Each round runs both sides of every workload back to back,
the order flipped every round (the machine is shared: alternating spreads the load over both sides). Figure: the
steady-state items/s the CLI prints as `throughput:` (compile and evaluation excluded); the median over rounds,
and the ratio of medians. The choices in `cpu_tuning.XNN_DOT_WORKLOADS`, `cpu_tuning.MALLOC_WORKLOADS` and
docs/benchmarks.md come from it. On a shared machine, run it as root under `chrt -f 50` (real-time priority: the
other jobs wait while it runs, so both sides see the same, quiet machine).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from systolic.runtime.cpu_settings import FLAGS_ENV, TWEAKS_ENV
from systolic.runtime.cpu_tuning import XNN_DOT_FLAGS

QUIET = ["observe.progress=off", "observe.tensorboard=false", "observe.plot=false"]
# Each workload's default recipe, shortened to about half a minute of stepping on a 2-core CPU.
RUNS = {
    "lm": ["train", "lm", "train.steps=200", "train.eval_every=200", "train.eval_batches=1", "sample.max_new_tokens=0",
           "checkpoint.every_steps=1000", *QUIET],
    "rl": ["train", "rl", "rl.eval_every=0", "rl.eval_episodes=1", "checkpoint.every_steps=1000", *QUIET],
    "gan": ["train", "gan", "train.steps=300", "train.eval_every=300", "gan.eval_samples=64",
            "checkpoint.every_steps=1000", *QUIET],
    "sim": ["simulate", "sim.t_end=10.0", "output.images=false", "checkpoint.every_steps=1000", *QUIET],
}
THROUGHPUT = re.compile(r"throughput: ([\d,.]+)")
# host_memory.apply's three mallopt values, as glibc reads them from the environment at start-up.
GLIBC_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
NO_MALLOC_TWEAK = "flatten,attention,barrier,grouped"


def run_once(workload: str, with_flag: bool, setting: str = "xnn") -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", FLAGS_ENV, TWEAKS_ENV, *GLIBC_MALLOC)}
    env.setdefault("JAX_PLATFORMS", "cpu")
    if setting == "malloc":
        env[TWEAKS_ENV] = NO_MALLOC_TWEAK
        if with_flag:
            env.update(GLIBC_MALLOC)
    elif with_flag:
        env["XLA_FLAGS"] = " ".join(XNN_DOT_FLAGS)
    else:
        env[FLAGS_ENV] = "off"
    with tempfile.TemporaryDirectory(prefix=f"xla-flags-{workload}-") as run_dir:
        proc = subprocess.run([sys.executable, "-m", "systolic", *RUNS[workload], "--run-dir", run_dir], env=env,
                              capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{workload} ({'with' if with_flag else 'without'} the flag) failed:\n{proc.stderr[-3000:]}")
    found = THROUGHPUT.findall(proc.stdout)
    if not found:
        raise SystemExit(f"{workload}: no `throughput:` line in its output:\n{proc.stdout[-3000:]}")
    return float(found[-1].replace(",", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setting", choices=("xnn", "malloc"), default="xnn")
    args = parser.parse_args()
    results: dict[str, dict[bool, list[float]]] = {w: {True: [], False: []} for w in args.workloads}
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; setting: "
          f"{' '.join(XNN_DOT_FLAGS) if args.setting == 'xnn' else ' '.join(f'{k}={v}' for k, v in GLIBC_MALLOC.items())}")
    for r in range(args.rounds):
        for workload in args.workloads:
            for with_flag in ((True, False) if r % 2 == 0 else (False, True)):
                t = time.perf_counter()
                value = run_once(workload, with_flag, args.setting)
                results[workload][with_flag].append(value)
                print(f"round {r + 1} {workload:>3} {'with   ' if with_flag else 'without'}: {value:12,.1f} items/s "
                      f"({time.perf_counter() - t:5.1f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    print("\n| workload | with the setting (median) | without (median) | with / without | median of the rounds' "
          "ratios | runs with; without |")
    print("|---|---|---|---|---|---|")
    for workload, sides in results.items():
        on, off = statistics.median(sides[True]), statistics.median(sides[False])
        # Each round's two runs are back to back: their ratio is the least exposed to the machine's load drifting.
        paired = statistics.median(a / b for a, b in zip(sides[True], sides[False]))
        runs = f"{', '.join(f'{v:,.0f}' for v in sides[True])}; {', '.join(f'{v:,.0f}' for v in sides[False])}"
        print(f"| {workload} | {on:,.1f} | {off:,.1f} | {on / off:.2f}x | {paired:.2f}x | {runs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
