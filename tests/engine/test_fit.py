"""The train step compiled ahead of time and checked against a device's memory (engine/fit.py): the figures of the
check, a compiler's RESOURCE_EXHAUSTED read as the same error, one compile for the check and the call, and the real
CLI refusing a step too large for a stated memory with one paragraph and no run directory left behind."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import monitoring
from jax.sharding import NamedSharding, PartitionSpec as P

from systolic.engine import fit
from systolic.runtime import memory
from systolic.runtime.memory import DoesNotFit, ProgramMemory
from tiny import LM_CLI_QUIET, TINY_LM, call

GIB = 2**30
ADVICE = "set model.remat=full"


def test_a_step_larger_than_the_stated_memory_is_refused_with_its_figures(monkeypatch):
    monkeypatch.setenv(memory.DEVICE_MEMORY_ENV, str(15 * GIB))
    step = ProgramMemory(argument_bytes=2 * GIB, output_bytes=2 * GIB, alias_bytes=2 * GIB, temp_bytes=14 * GIB,
                         code_bytes=0)
    assert step.peak_bytes == 16 * GIB
    with pytest.raises(DoesNotFit) as e:
        fit.check(step, jax.devices()[0], ADVICE)
    assert (e.value.need_bytes, e.value.have_bytes, e.value.fix) == (16 * GIB, 15 * GIB, ADVICE)
    message = str(e.value)
    assert "needs 16.00 GiB per device" in message and "has 15.00 GiB (SYSTOLIC_DEVICE_MEMORY_BYTES)" in message
    assert "temporaries 14.00 GiB" in message and message.endswith(f"Fix: {ADVICE}")
    fit.check(dataclasses.replace(step, temp_bytes=13 * GIB), jax.devices()[0], ADVICE)  # 15 GiB: fits exactly


def test_cpu_devices_report_no_memory_so_their_share_of_the_host_is_the_limit(monkeypatch):
    monkeypatch.delenv(memory.DEVICE_MEMORY_ENV, raising=False)
    assert memory.device_bytes(jax.devices()[0]) is None
    share = memory.host_bytes() // len(jax.devices())
    fit.check(ProgramMemory(share, 0, 0, 0, 0), jax.devices()[0], ADVICE)
    with pytest.raises(DoesNotFit, match="its share of the host's") as e:
        fit.check(ProgramMemory(share + 1, 0, 0, 0, 0), jax.devices()[0], ADVICE)
    assert e.value.have_bytes == share


def test_a_stated_memory_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv(memory.DEVICE_MEMORY_ENV, "16G")
    with pytest.raises(memory.UserError, match="expected a positive whole number of bytes"):
        memory.device_bytes(jax.devices()[0])


def test_the_compilers_out_of_memory_becomes_the_same_error_with_its_figures():
    # The lent TPU v5e's own text for llama-1b cut to 8 layers, batch 8 x 2048 (NOTES-jax-stack.md).
    text = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 16.57G "
            "of 15.75G hbm. Exceeded hbm capacity by 842.00M.\n\nTotal hbm usage >= 16.84G:")
    e = fit.out_of_memory(text, advice=ADVICE)
    assert e.need_bytes == pytest.approx(16.57 * GIB) and e.have_bytes == pytest.approx(15.75 * GIB)
    temporaries = ("RESOURCE_EXHAUSTED: the total memory required for HLO temporaries (16.57G) exceeds available HBM "
                   "(15.75G)")
    e = fit.out_of_memory(temporaries, advice=ADVICE)  # the temporaries: what the TPU compiler compares with the chip
    assert e.need_bytes == pytest.approx(16.57 * GIB) and e.have_bytes == pytest.approx(15.75 * GIB)
    assert "needs 16.57 GiB per device of the 15.75 GiB a device has" in str(e) and str(e).endswith(ADVICE)
    assert "\n" not in str(e)


def test_the_check_compiles_the_step_that_the_call_then_reuses():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    step = jax.jit(lambda s, b: (s + b.sum(), (s * b).sum()), in_shardings=(rows, rows),
                   out_shardings=(rows, whole), donate_argnums=0)
    state, batch = jax.device_put(jnp.ones(64), rows), jax.device_put(jnp.arange(64.0), rows)
    compiles = []

    def listen(name, _seconds, **_kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        step_memory = fit.compile_step(step, state, batch, advice=ADVICE)
        assert len(compiles) == 1
        state, _ = step(state, batch)
        state, _ = step(state, batch)
        assert len(compiles) == 1 and step._cache_size() == 1
    finally:
        monitoring.unregister_event_duration_listener(listen)
    # Per device: 8 float32 of each argument; out the state's 8 (in its donated buffer), a scalar, and on XLA:CPU the
    # output tuple's table of pointers.
    assert (step_memory.argument_bytes, step_memory.alias_bytes) == (64, 32) and step_memory.output_bytes >= 36
    assert float(state[0]) == 1 + 2 * sum(range(64))


def test_train_refuses_a_step_too_large_for_the_stated_memory(tmp_path, monkeypatch):
    # lm-tiny's step needs about 1.2 MiB per device (bench --json), and its arithmetic lower bound is under 8 x 1 MB:
    # so the compiled step, not the lower bound, is what is refused.
    monkeypatch.setenv(memory.DEVICE_MEMORY_ENV, "1000000")
    run_dir = tmp_path / "run"
    code, out, err = call("train", "lm", *TINY_LM, *LM_CLI_QUIET, "--run-dir", str(run_dir), "-q")
    assert code == 2, err
    assert err.startswith("error: The train step needs ") and "compiled program's memory analysis" in err
    assert "a cpu device has 976.56 KiB (SYSTOLIC_DEVICE_MEMORY_BYTES)" in err and "model.remat=full" in err
    assert "systolic plan lm --target <slice> --search" in err and err.count("error:") == 1
    assert not run_dir.exists()


def test_train_on_cpu_checks_the_compiled_step_against_each_devices_share_of_the_host(monkeypatch, tmp_path):
    """XLA:CPU reports no memory: a step past the host (1,000 scanned layers of lm-tiny, 55 GiB of it temporaries)
    ended in XLA's RESOURCE_EXHAUSTED traceback at its first allocation. A host of 8 MB stands for it here: the
    arithmetic lower bound fits 8 MB, the compiled step (about 1.2 MiB per device) not a device's 1 MB share."""
    monkeypatch.delenv(memory.DEVICE_MEMORY_ENV, raising=False)
    monkeypatch.setattr(memory, "host_bytes", lambda: 8_000_000)
    run_dir = tmp_path / "run"
    code, out, err = call("train", "lm", *TINY_LM, *LM_CLI_QUIET, "--run-dir", str(run_dir), "-q")
    assert code == 2 and err.startswith("error: The train step needs ") and err.count("error:") == 1, err
    assert f"its share of the host's memory (os.sysconf), split over {len(jax.devices())} CPU device(s)" in err
    assert not run_dir.exists()


def test_bench_refuses_the_same_step_before_timing_it(monkeypatch):
    monkeypatch.setenv(memory.DEVICE_MEMORY_ENV, "1000000")
    code, out, err = call("bench", "lm", *TINY_LM, *LM_CLI_QUIET, "--steps", "1", "--json")
    assert (code, out) == (2, "") and err.startswith("error: The train step needs ") and err.count("error:") == 1
