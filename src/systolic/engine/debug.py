"""Debug mode (`--debug`, `--no-jit`) and the train step's recompilation report (always on).

`--debug` turns on jax_debug_nans and jax_debug_infs inside the train loop (evaluation included; not around
sampling afterwards, whose masks are -inf by design), and runs the train step under `checkify` (NaN, out-of-bounds
index, integer division by zero): a failed check stops the run with `TrainingHalted` (exit code 3) naming the step,
the operation and the source line. The train step itself runs
with debug_nans off: checkify already reports a NaN there with its operation and line, while debug_nans would
pre-empt it with an error that names neither. An Inf inside the step is reported by the loop's non-finite guard
(the step and the first non-finite gradient leaf).

`--no-jit` runs everything eagerly under `jax.disable_jit()`, so `print` and `breakpoint()` work in the step.

Both cost nothing when off: the loop calls the workload's jitted step directly. docs/debugging.md has more.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify
from jax.sharding import NamedSharding, PartitionSpec as P

from systolic.errors import TrainingHalted
from systolic.runtime.cpu_tuning import cpu_compiler_options

CHECKS = checkify.nan_checks | checkify.index_checks | checkify.div_checks


@dataclasses.dataclass(frozen=True)
class DebugMode:
    checks: bool = False  # --debug
    jit: bool = True  # False under --no-jit


_MODE: contextvars.ContextVar[DebugMode] = contextvars.ContextVar("systolic_debug_mode", default=DebugMode())


def current() -> DebugMode:
    """The debug mode the CLI entered (the default, all off, otherwise)."""
    return _MODE.get()


@contextlib.contextmanager
def debug_mode(*, checks: bool = False, jit: bool = True) -> Iterator[None]:
    """Makes a debug mode current, with the jax settings it implies, for the duration of a run."""
    with contextlib.ExitStack() as stack:
        # Not jax_explain_cache_misses: at start-up every program misses, which buried the run's own lines under
        # JAX's (JAX_EXPLAIN_CACHE_MISSES=1 asks for them); the recompilation report names what a miss costs.
        if not jit:
            stack.enter_context(jax.disable_jit())
        token = _MODE.set(DebugMode(checks=checks, jit=jit))
        stack.callback(_MODE.reset, token)
        yield


@contextlib.contextmanager
def value_checks() -> Iterator[None]:
    """jax_debug_nans and jax_debug_infs while the train loop runs, in debug mode; nothing otherwise."""
    if not current().checks:
        yield
        return
    with jax.debug_nans(True), jax.debug_infs(True):
        yield


# CHECKIFY ---------------------------------------------------------------------------------------------------


class CheckedStep:
    """`train_step` under checkify: `(state, batch, step) -> (state, metrics)`, raising `TrainingHalted` (with the
    step number, the operation and its source line) when a check fails.

    JAX cannot instrument every program (a step jitted with `compiler_options`, a `while_loop` inside `shard_map`,
    as the simulations' adaptive steps): then a warning says so and the plain step runs on a copy of its input.
    When the guard finds that step non-finite, it runs again eagerly under jax_debug_nans/infs, which stops at the
    first operation that makes a NaN or Inf. (Letting jax_debug_nans see the jitted step's output instead makes jax
    re-run it op by op, which took over 10 minutes for a 32^2 simulation frame on one device.)
    """

    def __init__(self, train_step: Callable[[Any, Any], tuple[Any, Any]]):
        _work_around_batched_scatter_check()
        self.train_step = train_step
        self.instrumented: bool | None = None  # known after the first call
        self.jitted: Any = None  # made on the first call, for the state's shardings

    def __call__(self, state: Any, batch: Any, step: int) -> tuple[Any, Any]:
        if self.instrumented is None:
            self.jitted = self._make_jitted(jax.tree.map(lambda x: x.sharding, state))
            self.instrumented = self._instrument(state, batch)
        if not self.instrumented:
            return self._plain(state, batch)
        with jax.debug_nans(False), jax.debug_infs(False):
            error, out = self.jitted(state, batch)
        failure = describe_check_failure(error)  # fetches the error flags: one host sync per step in debug mode
        if failure is not None:
            raise TrainingHalted(
                f"--debug: step {step} failed a check: {failure}. The step's update was not applied; the last "
                "checkpoint is intact. Fix: inspect that line with this step's inputs (with --no-jit, a breakpoint() "
                "there stops in pdb); docs/debugging.md explains the report. Rerun the same command to resume."
            )
        return out

    def _make_jitted(self, shardings: Any) -> Any:
        """The checkified step, its new state laid out as its input was (`shardings`), as jit_step's plain step
        does: without that, XLA returns parameters with other shardings, and the second step, given them,
        compiles again (a recompilation a run without --debug does not have). Not donated: debug mode holds two
        copies of the state, so a failed step leaves its input readable. The checks triple the program; XLA:CPU at
        optimisation level 0 compiles it in about half the time (docs/benchmarks.md, "CPU tuning choices"), and
        debug runs are not about speed."""
        first = jax.tree.leaves(shardings)[0]
        replicated = NamedSharding(first.mesh, P()) if isinstance(first, NamedSharding) else first
        return jax.jit(checkify.checkify(self.train_step, errors=CHECKS), out_shardings=(replicated, (shardings,
                       replicated)), compiler_options=cpu_compiler_options(0))

    def _plain(self, state: Any, batch: Any) -> tuple[Any, Any]:
        saved = jax.tree.map(jnp.copy, state)  # the step donates its input; a failed step is re-run from this copy
        with jax.debug_nans(False), jax.debug_infs(False):
            out = self.train_step(state, batch)
        if not bool(out[1].get("finite", True)):  # the guard's verdict: one host sync per step in debug mode
            with jax.disable_jit():  # under the loop's jax_debug_nans/infs: raises FloatingPointError at the culprit
                self.train_step(saved, batch)
        return out

    def _instrument(self, state: Any, batch: Any) -> bool:
        try:
            # Traced under the loop's jax_debug_nans, so that the plain step, if it comes to that, is traced without
            # donation (debug_nans re-runs a step that made a NaN, which needs its inputs).
            self.jitted.lower(state, batch)
            return True
        except Exception as e:  # noqa: BLE001 - whatever JAX cannot instrument, the plain step still runs
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            warnings.warn(f"--debug: checkify cannot instrument this train step ({reason}); it runs without the "
                          "checks, and jax_debug_nans/jax_debug_infs report a NaN or Inf it makes instead.", stacklevel=2)
            return False

    def _cache_size(self) -> int:
        """Compiled versions of the function that runs (the recompilation report reads it like a jitted one's)."""
        fn = self.jitted if self.instrumented else self.train_step
        return fn._cache_size() if hasattr(fn, "_cache_size") else 0


def _work_around_batched_scatter_check() -> None:
    """JAX bug (0.10.2 and 0.11.2): checkify's out-of-bounds check of a scatter with batching dimensions, which is
    the gradient of `take_along_axis` (optax's integer-label cross-entropy), raises IndexError while tracing: its
    helper `scatter_oob` sizes the update window without the operand's batching dimensions. Such a scatter writes at
    the indices its forward gather read, and that gather is checked, so when the bug is present the scatter's own
    bounds check is skipped. Patches that private helper once, and only if needed; its signature is the same in
    jax 0.10 and 0.11, where the rule table's entries are not (0.11 added a context argument)."""
    try:
        from jax._src import checkify as impl  # private; if it moves, the bug (if still there) shows as an IndexError
    except ImportError:
        return

    def batched_scatter(x):  # (2, 3): per row, index 0 of x's last axis
        return jnp.take_along_axis(x, jnp.zeros((2, 1), jnp.int32), axis=1).sum()

    try:
        jax.eval_shape(checkify.checkify(jax.grad(batched_scatter), errors=checkify.index_checks), jnp.ones((2, 3)))
        return
    except IndexError:
        pass
    scatter_oob = impl.scatter_oob

    def tolerant_scatter_oob(operand, indices, updates, dnums):
        if not dnums.operand_batching_dims:
            return scatter_oob(operand, indices, updates, dnums)
        in_bounds = jnp.zeros(indices.shape, bool)  # "nothing out of bounds", with the payload checkify expects
        return jnp.any(in_bounds), impl.oob_payload(in_bounds, indices, dnums.scatter_dims_to_operand_dims,
                                                    operand.shape)

    impl.scatter_oob = tolerant_scatter_oob


def describe_check_failure(error: checkify.Error) -> str | None:
    """checkify's message plus where the failing operation is in the source; None when every check passed."""
    exc = error.get_exception()
    if exc is None:
        return None
    where = _source_lines(traceback.extract_tb(exc.traceback_info.as_python_traceback()))
    return f"{str(exc).strip().rstrip('.')}{where}"


def describe_floating_point_error(error: FloatingPointError) -> str:
    """jax_debug_nans/infs' message ("invalid value (nan) encountered in log") plus the source line."""
    return f"{error}{_source_lines(traceback.extract_tb(error.__traceback__))}"


def _source_lines(frames: list[traceback.FrameSummary]) -> str:
    """", at file:line in fn" for the innermost frame outside jax, and the innermost outside installed packages
    when that differs (a NaN inside optax is then also placed in the caller's code)."""
    jax_dir = str(Path(jax.__file__).parent)
    outside_jax = [f for f in frames if not f.filename.startswith(jax_dir) and f.filename != __file__]
    mine = [f for f in outside_jax if "site-packages" not in f.filename]
    chosen = outside_jax[-1:] + [f for f in mine[-1:] if f is not outside_jax[-1]]
    if not chosen:
        return ""
    return ", at " + ", called from ".join(f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in chosen)


def _short(path: str) -> str:
    """A path relative to the working directory, or from the package root inside site-packages."""
    if "site-packages" in path:
        return path.split("site-packages" + os.sep, 1)[1]
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if relative.startswith("..") else relative


# RECOMPILATION ----------------------------------------------------------------------------------------------


def signature(args: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    """What jit keys its compiled programs on, per argument leaf: {"batch['inputs']": (shape, dtype, sharding)}."""
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    out = {}
    for path, x in leaves:
        aval = jax.typeof(x)
        out[_name(path)] = (aval.shape, aval.dtype, aval.weak_type, x.sharding if isinstance(x, jax.Array) else None)
    return out


def explain_difference(old: dict[str, tuple[Any, ...]], new: dict[str, tuple[Any, ...]]) -> str:
    """One clause naming the first changed argument (and how many more changed)."""
    changes = []
    for name in [*new, *(n for n in old if n not in new)]:
        if name not in old:
            changes.append(f"{name} appeared")
        elif name not in new:
            changes.append(f"{name} disappeared")
        elif old[name] != new[name]:
            changes.append(f"{name} changed {_what_changed(old[name], new[name])}")
    if not changes:
        return ("no argument's shape, dtype or sharding changed (a jax setting, the current mesh or a static value "
                "did; run with --debug to see JAX's own explanation)")
    more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
    return changes[0] + more


def _what_changed(old: tuple[Any, ...], new: tuple[Any, ...]) -> str:
    (s0, d0, w0, h0), (s1, d1, w1, h1) = old, new
    if s0 != s1:
        return f"shape {s0} -> {s1}"
    if d0 != d1:
        return f"dtype {d0} -> {d1}"
    if w0 != w1:
        return f"weak type {w0} -> {w1} (a Python scalar became an array, or the reverse)"
    return f"sharding {_sharding(h0)} -> {_sharding(h1)}"


def _sharding(s: Any) -> str:
    if isinstance(s, jax.sharding.NamedSharding):
        return f"{s.spec} on mesh {dict(s.mesh.shape)}"
    return str(s)


def _name(path: tuple[Any, ...]) -> str:
    """("batch", "inputs") -> "batch['inputs']"; the top level names the step's argument."""
    return f"{path[0].key}{jax.tree_util.keystr(path[1:])}"


class RecompileWatch:
    """Notices when a jitted step compiles again after its first call and says which argument changed.

    Per step this reads the function's cache size (a C++ call); the argument signature is computed only on the
    first call and after a recompilation, so the report costs nothing in a healthy run.
    """

    def __init__(self, jitted: Any):
        self.jitted = jitted  # a jitted function, or a CheckedStep
        self.size: int | None = None
        self.signature: dict[str, tuple[Any, ...]] = {}

    def check(self, step: int, args: dict[str, Any]) -> str | None:
        """Call right after the step; returns the one-line report when this call compiled a new version."""
        if not hasattr(self.jitted, "_cache_size"):  # not a jitted function: nothing to watch
            return None
        size = self.jitted._cache_size()
        if self.size is None or size <= self.size:
            if self.size is None:
                self.size, self.signature = size, signature(args)
            return None
        old, self.size, self.signature = self.signature, size, signature(args)
        return f"step {step}: train step recompiled because {explain_difference(old, self.signature)}"
