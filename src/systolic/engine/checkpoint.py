"""Orbax checkpoints of a `TrainState` plus the data iterator's position and run metadata, with integrity checks.

Layout of `<run_dir>/checkpoints/<step>/`: `params`, `opt_state`, `train` (step, rng, extra) as array trees,
`data` and `meta` as JSON, and `systolic-manifest.json`. Params are their own item so `generate` can restore
them alone, without the optimizer state. The state's `frozen` parameters (a LoRA run's base weights) are not
saved: the loop rebuilds them (engine/loop.py).

Guarantees (tests/engine/test_checkpoint.py, tests/engine/test_reliability.py): a half-written step is never listed,
and old steps are deleted only after a newer one is complete (Orbax); a finished write is sealed by a manifest of
every file's SHA-256, and a restore that finds a file differing, missing or unreadable falls back to the previous
step; a failed write stops the run with `CheckpointWriteError`, earlier steps untouched; a step without a manifest
must at least load and be finite, else it is `CheckpointDamaged` and a resume sets it aside; an intact step that
does not fit the abstract target (another model size or optimizer) raises `CheckpointMismatch` and moves nothing.
Each guarantee's mechanism: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from systolic.config import CheckpointConfig
from systolic.engine.state import TrainState
from systolic.errors import CheckpointDamaged, CheckpointMismatch, CheckpointWriteError, UserError

MANIFEST = "systolic-manifest.json"
# How Orbax words a restore target that does not fit the saved tree (checked first by `Checkpointer.mismatch`).
_ORBAX_MISMATCH = ("tree structures do not match", "is not compatible with the stored shape")
FAULT_ENV = "SYSTOLIC_FAULT"  # testing aid: "kill_during_save:STEP" or "fail_save:STEP"


class _OrbaxFailureLogs(logging.Filter):
    """Orbax logs a failed save with its traceback (absl, ERROR, twice: its thread and its wait) and then raises
    the failure to us, where it becomes one paragraph (`CheckpointWriteError`): the logs would repeat it raw. On a
    full disk, the writes it abandons log again when collected ("asyncio: Task exception was never retrieved",
    after the paragraph). SYSTOLIC_DEBUG=1 keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _quiet() or record.levelno < logging.ERROR:
            return True
        abandoned = record.name == "asyncio" and "never retrieved" in str(record.msg) and "orbax" in record.getMessage()
        return not (abandoned or "orbax" in record.pathname)


def _quiet() -> bool:
    return os.environ.get("SYSTOLIC_DEBUG", "") in ("", "0")


class _ClosedLoopCallbacks:
    """A `sys.unraisablehook` that drops what tensorstore reports when a write that Orbax abandoned (a full disk)
    finishes after Orbax closed its event loop ("RuntimeError: Event loop is closed", one traceback per file,
    before the paragraph), and passes everything else to the hook it replaced."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        closed = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
        if not (closed and _quiet()):
            self.previous(unraisable)


_ORBAX_FILTER = _OrbaxFailureLogs()


# A state smaller than this is written before `save` returns, even with checkpoint.async_save: Orbax's background
# write is mostly Python (its event loop, tensorstore's callbacks), and for a small state it takes the host's time
# (and the GIL) from the loop's next steps for longer than writing it at once takes. Measured (2-core VM,
# 2026-12-07): rl-cartpole shrunk to 1 seed x 1 environment x 8 steps, a checkpoint every 10 chunks, ran 1,731 env
# steps/s with background writes and 6,199 written at once (9,375 without checkpoints), the same wall time. On the
# chip, the recipe's CLI ran at 1.46M env steps/s where its compiled chunks ran 6.65M. Large states (an lm's
# parameters and optimizer) still write in the background while training goes on.
BACKGROUND_WRITE_BYTES = 64 * 2**20


def _state_bytes(state: Any) -> int:
    return sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state))


class Checkpointer:
    def __init__(self, directory: Path, cfg: CheckpointConfig):
        logging.getLogger("absl").addFilter(_ORBAX_FILTER)  # once: a filter object is added only once
        logging.getLogger("asyncio").addFilter(_ORBAX_FILTER)
        if not isinstance(sys.unraisablehook, _ClosedLoopCallbacks):  # once per process
            sys.unraisablehook = _ClosedLoopCallbacks(sys.unraisablehook)
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._unsealed: list[int] = []  # steps written (or being written) whose manifest is not yet recorded

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    # SAVING -----------------------------------------------------------------------------------------------------

    def save(self, state: TrainState, data_state: dict[str, Any] | None, meta: dict[str, Any]) -> None:
        step = int(jax.device_get(state.step))
        self._seal()
        items = {
            "params": ocp.args.StandardSave(state.params),
            "train": ocp.args.StandardSave(_train_item(state)),
            "data": ocp.args.JsonSave(data_state or {}),
            "meta": ocp.args.JsonSave(meta),
        }
        if jax.tree.leaves(state.opt_state):  # Orbax rejects an empty item (a simulation has no optimizer)
            items["opt_state"] = ocp.args.StandardSave(state.opt_state)
        try:
            _injected_fault("fail_save", step)
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
            _injected_fault("kill_during_save", step)  # the write is under way in the background thread
        except Exception as e:  # noqa: BLE001 - any failure to write is reported the same way
            raise self._write_error(step, e) from None
        self._unsealed.append(step)
        if _state_bytes(state) < BACKGROUND_WRITE_BYTES:
            self._seal()

    def wait(self) -> None:
        """Blocks until every write has finished and been sealed with its manifest."""
        self._seal()

    def _seal(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._write_error(self._unsealed[-1] if self._unsealed else -1, e) from None
        if jax.process_index() == 0:
            for step in self._unsealed:
                step_dir = self.directory / str(step)
                if step_dir.is_dir():
                    _write_manifest(step_dir)
        self._unsealed.clear()

    def _write_error(self, step: int, error: Exception) -> CheckpointWriteError:
        previous = [s for s in self.all_steps() if s != step]
        kept = f"the previous checkpoint (step {previous[-1]}) is intact" if previous else "no earlier checkpoint exists"
        return CheckpointWriteError(
            f"Writing the checkpoint for step {step} to {self.directory} failed: {error}. The run stopped; {kept}. "
            "Fix: free disk space or fix the directory's permissions, then rerun the same command to resume."
        )

    # RESTORING --------------------------------------------------------------------------------------------------

    def verify(self, step: int) -> str | None:
        """None when the step's files match its manifest; else what is wrong. A step without a manifest (the
        process died between finishing the write and sealing it) cannot be verified and is accepted."""
        step_dir = self.directory / str(step)
        manifest = step_dir / MANIFEST
        if not manifest.exists():
            return None
        try:
            expected = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, a 5,000-digit number
            return f"its manifest is unreadable ({type(e).__name__}: {str(e)[:200]})"
        if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
            return f"its manifest is not an object of {{file: SHA-256}} (it holds {str(expected)[:80]!r})"
        outside = [name for name in expected if Path(name).is_absolute() or ".." in Path(name).parts]
        if outside:
            return f"its manifest names {outside[0]!r}, a path outside the step's directory"
        for name, digest in expected.items():
            path = step_dir / name
            try:
                actual = _sha256(path)
            except OSError:
                return f"{name} is missing or unreadable"
            if actual != digest:
                return f"{name} does not match its recorded checksum"
        return None

    def latest_intact_step(self) -> int | None:
        """The newest step whose files match their manifest (warning about any newer damaged ones)."""
        for step in reversed(self.all_steps()):
            problem = self.verify(step)
            if problem is None:
                return step
            warnings.warn(f"Checkpoint step {step} in {self.directory} is damaged: {problem}. Trying an earlier one.")
        return None

    def restore_latest(self, abstract: TrainState, workload: str) -> tuple[TrainState, dict[str, Any], int] | None:
        """The newest intact step, falling back past damaged ones with a warning; None when there is none. An intact
        step that does not fit `abstract` stops the resume with a UserError and changes nothing."""
        steps = self.all_steps()
        damaged: list[int] = []
        for step in reversed(steps):
            problem = self.verify(step)
            if problem is None:
                try:
                    meta = self.restore_meta(step)
                except Exception as e:  # noqa: BLE001 - a damaged step is reported and skipped
                    problem = f"its metadata cannot be read ({type(e).__name__})"
            if problem is None:
                if meta.get("workload") != workload:
                    raise UserError(
                        f"The checkpoint at {self.directory}/{step} was written by the '{meta.get('workload')}' "
                        f"workload, not '{workload}'. Fix: pass a fresh --run-dir, or run the matching workload."
                    )
                try:
                    state, data_state, _ = self.restore(step, abstract)
                    self._set_aside(damaged)
                    if not (self.directory / str(step) / MANIFEST).exists():
                        # Killed between writing and sealing, or the manifest was deleted: nothing to check against.
                        warnings.warn(f"Checkpoint step {step} in {self.directory} has no {MANIFEST}, so its files "
                                      "could not be checked for damage; resumed from it unverified.")
                    return state, data_state, step
                except CheckpointMismatch as e:
                    # The files are intact: the config changed, so an earlier step would not fit either.
                    raise UserError(
                        f"The run's checkpoint {self.directory}/{step} does not match its config ({e.detail}): the "
                        "model or optimizer settings changed since it was saved (was config.yaml edited?). Nothing was "
                        "changed. Fix: resume with the settings it was saved with, or start over with a new --run-dir "
                        "or checkpoint.resume=false."
                    ) from None
                except CheckpointDamaged as e:
                    problem = f"it has no manifest and {e.detail}"
                except Exception as e:  # noqa: BLE001
                    problem = f"it cannot be restored ({type(e).__name__}: {str(e)[:200]})"
            warnings.warn(f"Checkpoint step {step} in {self.directory} is damaged: {problem}. Trying an earlier one.")
            damaged.append(step)
        if steps:
            raise UserError(
                f"None of the checkpoints in {self.directory} (steps {steps}) is intact, so the run cannot resume. "
                "Nothing was changed. Fix: move that directory away to start over, or restore it from a backup."
            )
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Damaged steps newer than the one resumed from are renamed, not deleted (they may still hold something
        worth saving by hand), so the resumed run can write those step numbers again."""
        if jax.process_index() != 0:
            return
        for step in steps:
            target = self.directory / f"damaged-{step}-{int(time.time())}"
            os.replace(self.directory / str(step), target)
            warnings.warn(f"Moved the damaged checkpoint step {step} aside to {target}.")
        if steps:
            self._manager.reload()

    def restore(self, step: int, abstract: TrainState) -> tuple[TrainState, dict[str, Any], dict[str, Any]]:
        """Restores onto the shardings in `abstract` (ShapeDtypeStructs), whatever mesh the step was saved from.
        Raises CheckpointMismatch when the saved arrays do not fit `abstract`."""
        arrays = {"params": abstract.params, "train": _train_item(abstract)}
        if jax.tree.leaves(abstract.opt_state):
            arrays["opt_state"] = abstract.opt_state
        items = {name: ocp.args.StandardRestore(tree) for name, tree in arrays.items()}
        out = self._restore_fitting(step, arrays, {**items, "data": ocp.args.JsonRestore(), "meta": ocp.args.JsonRestore()})
        self._check_unverified(step, {name: out[name] for name in arrays})
        train = out["train"]
        state = TrainState(step=train["step"], params=out["params"], opt_state=out.get("opt_state", abstract.opt_state),
                           rng=train["rng"], extra=train.get("extra", {}), frozen=abstract.frozen)
        return state, out["data"], out["meta"]

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """The parameters alone (no optimizer state); raises CheckpointMismatch when they do not fit."""
        args = {"params": ocp.args.StandardRestore(abstract_params)}
        params = self._restore_fitting(step, {"params": abstract_params}, args)["params"]
        self._check_unverified(step, {"params": params})
        return params

    def _unverified(self, step: int) -> bool:
        return not (self.directory / str(step) / MANIFEST).exists()

    def _check_unverified(self, step: int, items: dict[str, Any]) -> None:
        """A step without a manifest was not checked against checksums, so its restored values are: flipped bytes
        that still decompress show up as NaN/Inf far more often than not (a float's exponent bits)."""
        if not self._unverified(step):
            return
        for name, tree in items.items():
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                if jnp.issubdtype(leaf.dtype, jnp.inexact) and not bool(jnp.isfinite(leaf).all()):
                    where = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                    raise CheckpointDamaged(self.directory, step, f"its {name}.{where} holds NaN or Inf")

    def mismatch(self, step: int, arrays: dict[str, Any]) -> str | None:
        """What differs between the array items saved at `step` and `arrays` (item name -> abstract tree): leaves on
        one side only, and shapes; None when they fit. Dtypes may differ: Orbax casts on restore."""
        differences: list[str] = []
        for item, abstract in arrays.items():
            folder = self.directory / str(step) / item
            if not folder.is_dir():
                differences.append(f"the checkpoint has no {item}")
                continue
            handler = ocp.StandardCheckpointHandler()
            try:
                saved = _leaf_shapes(handler.metadata(folder).tree)
            finally:
                handler.close()
            wanted = _leaf_shapes(abstract)
            for name in sorted(saved.keys() | wanted.keys()):
                if name not in saved:
                    differences.append(f"{item}.{name} only in the config, shape {wanted[name]}")
                elif name not in wanted:
                    differences.append(f"{item}.{name} only in the checkpoint, shape {saved[name]}")
                elif saved[name] != wanted[name]:
                    differences.append(f"{item}.{name}: checkpoint {saved[name]}, config {wanted[name]}")
        if not differences:
            return None
        more = f"; and {len(differences) - 3} more" if len(differences) > 3 else ""
        return "; ".join(differences[:3]) + more

    def _restore_fitting(self, step: int, arrays: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        # Checked before reading: Orbax reports a shape mismatch only after starting the reads, and the abandoned
        # reads then print tracebacks to stderr when garbage-collected.
        try:
            detail = self.mismatch(step, arrays)
            if detail is not None:
                raise CheckpointMismatch(self.directory, step, detail)
            return self._manager.restore(step, args=ocp.args.Composite(**args))
        except CheckpointMismatch:
            raise
        except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types for damaged bytes
            text = str(e)
            if isinstance(e, ValueError) and any(sign in text for sign in _ORBAX_MISMATCH):
                raise CheckpointMismatch(self.directory, step, " ".join(text.split())[:300]) from None
            if self._unverified(step):
                cause = e
                while cause.__cause__ is not None:  # TensorStore's own words (e.g. "Data corruption detected")
                    cause = cause.__cause__
                words = " ".join(str(cause).split())
                raise CheckpointDamaged(self.directory, step, f"its arrays do not load ({type(cause).__name__}: "
                                        f"{words[:200]})") from None
            raise

    def restore_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata saved with `step`; a UserError when it is unreadable or not an object."""
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - Orbax raises many types for a damaged item
            raise UserError(f"The checkpoint {self.directory}/{step} has unreadable metadata ({type(e).__name__}: "
                            f"{str(e)[:200]}). Fix: restore the run directory from a backup, or pass another.") from None
        if not isinstance(meta, dict):
            raise UserError(f"The checkpoint {self.directory}/{step} has metadata of the wrong shape (a "
                            f"{type(meta).__name__}, not an object). Fix: restore the run directory from a backup.")
        return meta

    def close(self) -> None:
        try:
            self._manager.close()
        except Exception:  # noqa: BLE001 - a failed write was already reported by _seal
            pass


def has_checkpoints(run_dir: Path) -> bool:
    """Whether `run_dir/checkpoints` holds at least one step folder (cheap: no Orbax, no verification)."""
    folder = Path(run_dir) / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def _train_item(state: TrainState) -> dict[str, Any]:
    item = {"step": state.step, "rng": state.rng}
    if jax.tree.leaves(state.extra):  # Orbax rejects an empty subtree
        item["extra"] = state.extra
    return item


def _leaf_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{"blocks.0.attn.wq": shape}: dotted names that agree between an abstract tree (integer dict keys, tuples,
    named tuples) and Orbax's metadata of the saved one (string keys, lists)."""
    def name(path: tuple[Any, ...]) -> str:
        return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)

    return {name(path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(step_dir: Path) -> None:
    files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {str(p.relative_to(step_dir)): _sha256(p) for p in files}
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=0))
    os.replace(tmp, step_dir / MANIFEST)


def _injected_fault(kind: str, step: int) -> None:
    if os.environ.get(FAULT_ENV, "") != f"{kind}:{step}":
        return
    if kind == "kill_during_save":
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(errno.ENOSPC, "No space left on device (injected by SYSTOLIC_FAULT)")
