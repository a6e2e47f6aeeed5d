"""The persistent compilation cache: a second run of the same program compiles nothing new."""

import os
import subprocess
import sys

from tiny import LM_CLI_QUIET, TINY_LM

TINY = [*TINY_LM, *LM_CLI_QUIET, "train.steps=2", "-q"]  # 2 steps: the test is about compiling, not training


def test_warm_start_hits_the_cache(tmp_path):
    cache = tmp_path / "xla-cache"
    env = dict(os.environ, SYSTOLIC_COMPILE_CACHE=str(cache))

    def run(name):
        proc = subprocess.run([sys.executable, "-m", "systolic", "train", "lm", *TINY, "--run-dir", str(tmp_path / name)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return sorted(p.name for p in cache.rglob("*") if p.is_file())

    cold = run("cold")
    assert len(cold) >= 3  # init, train step, eval step at least
    warm = run("warm")
    assert warm == cold, "the warm run compiled programs the cold run had already cached"
