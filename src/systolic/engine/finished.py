"""One way to open a finished run: its config, its newest intact checkpoint, and restores that explain a mismatch.

`systolic generate`, `export`, `convert to-hf`, `sample gan`, `eval rl` and `init.from` all start here, so they
check the same things in the same order and say the same thing when one fails:

    with open_run(run_dir, LMConfig, "systolic export") as run:   # config read, workload checked, step chosen
        params = run.restore_params(abstract_params)           # a UserError if they do not fit the config
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from systolic.engine import rundir
from systolic.engine.checkpoint import Checkpointer
from systolic.engine.state import TrainState
from systolic.errors import CheckpointMismatch, UserError


def read_config(run_dir: Path, schema: type, command: str) -> Any:
    """The run's config.yaml, read with `schema` (a workload's config class; its `workload` field names it); a
    UserError unless the run is a run of that workload. `command` is what the user ran ("systolic generate",
    "init.from=RUN") and names it in the errors."""
    workload = schema.workload

    def schema_for(declared: str | None) -> type:
        if declared != workload:  # before its keys: another workload's sections would read as misspellings
            raise UserError(f"{run_dir} holds a '{declared}' run; `{command}` needs the directory of a `systolic "
                            f"train {workload}` run. Fix: pass one (by default runs/<recipe>).")
        return schema

    return rundir.load_config(run_dir, schema_for)


@dataclasses.dataclass
class FinishedRun:
    """An open run: `cfg` from its config.yaml, `step` its newest checkpoint whose checksums verify. Close it (or
    use it as a context manager) to release the Checkpointer."""

    run_dir: Path
    cfg: Any
    step: int
    command: str
    checkpointer: Checkpointer

    def meta(self) -> dict[str, Any]:
        """The JSON metadata saved with the checkpoint (workload, vocab, ...)."""
        return self.checkpointer.restore_meta(self.step)

    def restore(self, abstract: TrainState) -> TrainState:
        """The whole train state, onto the shardings of `abstract` (ShapeDtypeStructs)."""
        try:
            state, _, _ = self.checkpointer.restore(self.step, abstract)
        except CheckpointMismatch as e:
            raise self._mismatch(e) from None
        return state

    def restore_params(self, abstract_params: Any) -> Any:
        """The parameters alone (no optimizer state), onto the shardings of `abstract_params`."""
        try:
            return self.checkpointer.restore_params(self.step, abstract_params)
        except CheckpointMismatch as e:
            raise self._mismatch(e) from None

    def _mismatch(self, e: CheckpointMismatch) -> UserError:
        return UserError(
            f"{self.run_dir}: this run's checkpoint (step {self.step}) does not match its config ({e.detail}). Was "
            f"config.yaml edited? Nothing was changed. Fix: put the settings the run was trained with back into "
            f"{Path(self.run_dir) / rundir.CONFIG_FILE}, or pass another run directory to `{self.command}`."
        )

    def close(self) -> None:
        self.checkpointer.close()

    def __enter__(self) -> FinishedRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_run(run_dir: Path, schema: type, command: str) -> FinishedRun:
    """Reads the run's config with `schema` (a workload's config class), checks it is a run of that workload and
    picks its newest intact (checksum-verified) checkpoint, warning about newer damaged ones. Raises a UserError
    when there is none."""
    run_dir = Path(run_dir)
    cfg = read_config(run_dir, schema, command)
    workload = schema.workload
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        raise _nothing_to_open(run_dir, workload, command, "")
    ckpt = Checkpointer(folder, cfg.checkpoint)
    step = ckpt.latest_intact_step()
    if step is None:
        steps = ckpt.all_steps()
        ckpt.close()
        damage = f" (steps {steps} are all damaged)" if steps else ""
        raise _nothing_to_open(run_dir, workload, command, damage)
    return FinishedRun(run_dir=run_dir, cfg=cfg, step=step, command=command, checkpointer=ckpt)


def _nothing_to_open(run_dir: Path, workload: str, command: str, damage: str) -> UserError:
    return UserError(f"{run_dir} has no complete checkpoint{damage}, so `{command}` has nothing to use. Fix: train first "
                     f"(`systolic train {workload} --run-dir {run_dir}`), or pass another run directory.")

