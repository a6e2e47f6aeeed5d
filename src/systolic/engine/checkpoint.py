"""Orbax checkpoints of a `TrainState` plus the data iterator's position and run metadata.

Layout of `<run_dir>/checkpoints/<step>/`: `params`, `opt_state`, `train` (step, rng, extra) as array trees,
`data` and `meta` as JSON. Params are their own item so `generate` can restore them alone, without the
optimizer state (3x the parameters' memory under Adam). Orbax writes each step to a temporary directory and
renames it when complete, so a half-written step is never listed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from systolic.config import CheckpointConfig
from systolic.engine.state import TrainState


class Checkpointer:
    def __init__(self, directory: Path, cfg: CheckpointConfig):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, state: TrainState, data_state: dict[str, Any] | None, meta: dict[str, Any]) -> None:
        step = int(jax.device_get(state.step))
        items = {
            "params": ocp.args.StandardSave(state.params),
            "opt_state": ocp.args.StandardSave(state.opt_state),
            "train": ocp.args.StandardSave(_train_item(state)),
            "data": ocp.args.JsonSave(data_state or {}),
            "meta": ocp.args.JsonSave(meta),
        }
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract: TrainState) -> tuple[TrainState, dict[str, Any], dict[str, Any]]:
        """Restores onto the shardings in `abstract` (ShapeDtypeStructs), whatever mesh the step was saved from."""
        items = {
            "params": ocp.args.StandardRestore(abstract.params),
            "opt_state": ocp.args.StandardRestore(abstract.opt_state),
            "train": ocp.args.StandardRestore(_train_item(abstract)),
            "data": ocp.args.JsonRestore(),
            "meta": ocp.args.JsonRestore(),
        }
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        train = out["train"]
        state = TrainState(step=train["step"], params=out["params"], opt_state=out["opt_state"], rng=train["rng"],
                           extra=train.get("extra", {}))
        return state, out["data"], out["meta"]

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        out = self._manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params)))
        return out["params"]

    def restore_meta(self, step: int) -> dict[str, Any]:
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def _train_item(state: TrainState) -> dict[str, Any]:
    item = {"step": state.step, "rng": state.rng}
    if jax.tree.leaves(state.extra):  # Orbax rejects an empty subtree
        item["extra"] = state.extra
    return item
