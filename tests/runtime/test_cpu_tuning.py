"""The CPU tuning (runtime/cpu_tuning.py): read once, applied only by an explicit start call, never at import."""

import os
import subprocess
import sys
from importlib import metadata

import pytest

from systolic.runtime import cpu_tuning
from systolic.runtime.cpu_settings import CpuTuning


def test_importing_systolic_leaves_xla_flags_alone():
    flags = "--xla_cpu_enable_fast_math=false"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SYSTOLIC_"))}
    env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    code = "import os, systolic, systolic.workloads.lm.train; print(os.environ['XLA_FLAGS'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == flags


def test_settings_follow_the_environment():
    assert CpuTuning.from_env({}) == CpuTuning()
    assert CpuTuning.from_env({"SYSTOLIC_CPU_TWEAKS": "none", "SYSTOLIC_XLA_CPU_FLAGS": "off"}) == CpuTuning(
        xla_flags=False, flatten=False, attention=False, barrier=False, grouped=False, malloc=False)
    assert CpuTuning.from_env({"SYSTOLIC_CPU_TWEAKS": " flatten, malloc "}) == CpuTuning(attention=False, barrier=False,
                                                                                       grouped=False)


@pytest.mark.skipif(not metadata.version("jaxlib").startswith(cpu_tuning.VERIFIED_JAXLIB), reason="unverified jaxlib")
def test_start_adds_the_xla_flags_for_the_workloads_they_help_unless_switched_off(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    off = CpuTuning.from_env({"SYSTOLIC_XLA_CPU_FLAGS": "off"})
    # No workload measured faster with them on the current host (docs/benchmarks.md), so the mechanism is checked
    # with a workload marked as helped.
    helped = "lm"
    monkeypatch.setattr(cpu_tuning, "XNN_DOT_WORKLOADS", frozenset({helped}))
    assert cpu_tuning.apply_at_start(workload=helped, stepping=False, tuning=off) == (False, False)
    # A workload not in the set (rl ran at 0.68x with them) and a command that runs no workload get none.
    for workload in ("rl", None):
        assert cpu_tuning.apply_at_start(workload=workload, stepping=False, tuning=CpuTuning()) == (False, False)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert cpu_tuning.apply_at_start(workload=helped, stepping=False, tuning=CpuTuning()) == (True, False)
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", *cpu_tuning.XNN_DOT_FLAGS]
    # Already there (a user's XLA_FLAGS mention them): left as they are.
    assert cpu_tuning.apply_at_start(workload=helped, stepping=False, tuning=CpuTuning()).xla_flags is False


@pytest.mark.parametrize("argv, workload", [
    (["train", "rl"], "rl"), (["train", "lm"], "lm"), (["simulate"], "sim"), (["fit", "sim"], "sim"),
    (["bench", "lm"], "lm"), (["generate", "runs/x"], "lm"), (["eval", "rl", "runs/x"], "rl"), (["info"], None),
])
def test_the_cli_knows_each_command_s_workload_before_jax_starts(argv, workload):
    from systolic import cli

    args, _ = cli._parser().parse_known_args(argv)
    assert args.workload == workload  # what cli.main hands startup.prepare
