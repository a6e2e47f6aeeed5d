"""Time to first step with an empty (cold) and a filled (warm) persistent compilation cache.

Each round makes a fresh cache directory, runs `systolic bench` once into it (cold: XLA compiles everything)
and once more (warm: compiled programs are read back), alternating, and prints the medians: the whole process
from start to exit, and the first train step alone (its compile, or its cache read, plus one step).

    python benchmarks/studies/compile_cache.py                        # lm-tiny, 3 rounds
    python benchmarks/studies/compile_cache.py --recipe gpt2-tiny --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def run_once(recipe: str, cache: str) -> tuple[float, float]:
    env = dict(os.environ, SYSTOLIC_COMPILE_CACHE=cache)
    cmd = [sys.executable, "-m", "systolic", "bench", "lm", "--recipe", recipe, "--steps", "1", "--json"]
    t = time.perf_counter()
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - t
    return wall, json.loads(out.strip().splitlines()[-1])["compile_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="lm-tiny")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    results: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
    for _ in range(a.rounds):
        with tempfile.TemporaryDirectory(prefix="systolic-cache-") as cache:
            results["cold"].append(run_once(a.recipe, cache))
            results["warm"].append(run_once(a.recipe, cache))
    print(f"systolic bench lm --recipe {a.recipe}: median of {a.rounds} rounds, {os.cpu_count()} CPUs")
    print(f"{'cache':<6} {'process wall s':>15} {'first step s':>13}")
    for name, rows in results.items():
        print(f"{name:<6} {statistics.median(r[0] for r in rows):>15.1f} {statistics.median(r[1] for r in rows):>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
