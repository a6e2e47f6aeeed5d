"""Will the train step fit? The step is compiled ahead of time for the first call's arguments and its memory analysis
is checked against one device's memory before any step runs.

The arithmetic lower bounds (runtime/memory.py `check_fits`, an lm's preflight.py) refuse a config that cannot
fit before anything is traced; this is the exact figure, for a step close to the limit: a lent TPU v5e ended
`systolic bench` of an 8-layer llama-1b in a RESOURCE_EXHAUSTED traceback (temporaries 16.57G of 15.75G HBM). Here
both a program that the analysis says is too large and a compiler that stops with RESOURCE_EXHAUSTED (the TPU
compiler checks HBM itself) end as `DoesNotFit`, the CLI's one paragraph with exit code 2.

Nothing compiles twice: `jit(f).lower(args).compile()` puts the executable in jax's compilation cache, and the
call with the same arguments that follows finds it there (tests/engine/test_fit.py counts the compiles). The
jitted function stays the train step, so the recompilation watch (debug.py) still sees its cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from systolic.runtime import memory
from systolic.runtime.memory import DoesNotFit, ProgramMemory


def compile_step(train_step: Any, state: Any, batch: Any, *, advice: str) -> ProgramMemory | None:
    """Compiles the jitted `train_step` for (`state`, `batch`) and returns its memory per device; `DoesNotFit` when
    it needs more than a device has (`advice`: the fix). None for a step that is not jitted (nothing to analyse)."""
    if not hasattr(train_step, "lower"):
        return None
    with compiler_memory(advice):
        compiled = train_step.lower(state, batch).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:  # a backend without a memory analysis
        return None
    step_memory = ProgramMemory.of(analysis)
    check(step_memory, jax.local_devices()[0], advice)
    return step_memory


def check(step_memory: ProgramMemory, device: Any, advice: str) -> None:
    """`DoesNotFit` when the compiled step's memory exceeds `device`'s (where its size is known). Not on a TPU: its
    compiler checks the program's temporaries against the chip's memory itself (RESOURCE_EXHAUSTED, `out_of_memory`
    here), and the analysis' sum overshoots the chip there: llama-1b cut to 8 layers at 8 x 2048 with
    remat=except_mlp ran on the lent v5e with arguments 5.45 GiB + temporaries 12.66 GiB, 18.1 GiB of 15.75."""
    if device.platform == "tpu":
        return
    have = memory.device_bytes(device) or _host_share(device)
    need = step_memory.peak_bytes
    if have is None or need <= have[0]:
        return
    m, gib = step_memory, memory.size_text
    raise DoesNotFit(
        f"The train step needs {gib(need)} per device (the compiled program's memory analysis: arguments "
        f"{gib(m.argument_bytes)} + outputs {gib(m.output_bytes)} - {gib(m.alias_bytes)} of them in donated buffers "
        f"+ temporaries {gib(m.temp_bytes)} + code {gib(m.code_bytes)}), but a {device.device_kind} device has "
        f"{gib(have[0])} ({have[1]}), so it cannot run; no step ran. Fix: {advice}",
        need_bytes=need, have_bytes=have[0], fix=advice)


def _host_share(device: Any) -> tuple[int, str] | None:
    """A CPU device's share of the host's memory (the process's CPU devices split it), which XLA:CPU reports nowhere:
    without it a step far past the host (a 1,000-layer scanned model) would run until its first allocation failed."""
    if device.platform != "cpu" or not (host := memory.host_bytes()):
        return None
    count = sum(d.platform == "cpu" for d in jax.local_devices())
    return host // count, f"its share of the host's memory (os.sysconf), split over {count} CPU device(s)"


@contextlib.contextmanager
def compiler_memory(advice: str, what: str = "The train step") -> Iterator[None]:
    """A compile inside this block that the compiler stops with RESOURCE_EXHAUSTED ends as `DoesNotFit` for `what`,
    with its figures and `advice`; any other error passes as it is."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise out_of_memory(str(e), advice, what) from None


def out_of_memory(message: str, advice: str, what: str = "The train step") -> DoesNotFit:
    """The compiler's RESOURCE_EXHAUSTED for `what` (a program) as `DoesNotFit`, with the figures read from its
    text."""
    first = message.strip().splitlines()[0] if message.strip() else "RESOURCE_EXHAUSTED"
    need, have = memory.needed_bytes(message), memory.limit_bytes(message)
    figures = (f"needs {memory.size_text(need) if need else 'more'} per device of the "
               f"{memory.size_text(have) if have else 'memory'} a device has")
    return DoesNotFit(f"{what} {figures}: the compiler stopped with RESOURCE_EXHAUSTED ({first}); no step ran. "
                      f"Fix: {advice}", need_bytes=need or 0, have_bytes=have or 0, fix=advice)
