"""The host allocator settings (runtime/host_memory.py): XLA's per-call buffers stop page-faulting in."""

import os
import subprocess
import sys
import textwrap

import pytest

from systolic.runtime import host_memory
from systolic.runtime.cpu_settings import CpuTuning

# 60 warm-up calls let the heap reach about its steady size (it can still grow now and then); then count the
# minor page faults of 20 more calls.
_PROBE = textwrap.dedent("""
    import resource, sys, jax, jax.numpy as jnp
    from systolic.runtime import cpu_tuning
    print(cpu_tuning.apply_at_start(workload=sys.argv[1], stepping=True).malloc)
    f = jax.jit(lambda x: jnp.sin(x) * 2 + jnp.cos(x)[::-1])
    x = jnp.ones((4096, 4096))  # 64 MiB: glibc would mmap a block this size afresh on every call
    for _ in range(60):
        f(x).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        f(x).block_until_ready()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
""")


def _faults_per_call(tweaks: str, workload: str = "lm") -> tuple[bool, float]:
    env = dict(os.environ, SYSTOLIC_CPU_TWEAKS=tweaks, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device is enough
    out = subprocess.run([sys.executable, "-c", _PROBE, workload], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.strip().splitlines()[-2:]
    return applied == "True", float(faults)


@pytest.mark.slow  # about 90 s on 2 cores: two subprocesses fault in 64 MiB page by page
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_buffers_stop_faulting_in_with_the_setting_and_do_without_it():
    pages = 4096 * 4096 * 4 // 4096
    applied, without = _faults_per_call("none")
    assert not applied
    assert without > 0.5 * pages, f"expected the output buffer to fault in every call, got {without} faults"
    applied, with_setting = _faults_per_call("all")
    assert applied
    assert with_setting < 0.25 * pages, f"{with_setting} page faults per call with the allocator settings on"
    # A workload it slows (rl: PPO at 0.56-0.65x, docs/benchmarks.md) keeps glibc's defaults.
    applied, _ = _faults_per_call("all", workload="rl")
    assert not applied


def test_wanted_follows_the_tweaks_and_the_platform(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.wanted(CpuTuning.from_env({"SYSTOLIC_CPU_TWEAKS": "all"}))
    assert host_memory.wanted(CpuTuning.from_env({"SYSTOLIC_CPU_TWEAKS": "flatten,malloc"}))
    assert not host_memory.wanted(CpuTuning.from_env({"SYSTOLIC_CPU_TWEAKS": "none"}))
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not host_memory.wanted(CpuTuning())


def test_does_nothing_once_jax_has_started():
    import jax

    jax.numpy.zeros(1).block_until_ready()  # this process's backend is up (conftest's 8 devices)
    assert not host_memory.apply(CpuTuning())
