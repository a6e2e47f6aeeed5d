"""What every sim solver builds and shares: the `Simulation` record (a sharded initial state and one jitted frame
step for the engine's loop), its state's layout, the float64 switch, the step count per frame and the memory check.

A frame advances the fields by `sim.t_end / output.frames` of simulated time: many solver steps inside one
`shard_map`, so the host dispatches once per frame and the devices exchange only what the algorithm needs
(slab transposes for the 2-D spectral solver, pencil transposes in 3-D, halos for finite differences). The state
is the engine's `TrainState`: `step` counts frames, `params` holds the fields, `extra["time"]` the simulated time.

Its own module, below the solvers (solver.py: the 2-D ones and the choice among all; solver_3d.py: 3-D turbulence),
so that no solver imports another for the contract they share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.engine.state import TrainState
from systolic.engine.step import jit_step
from systolic.runtime import memory
from systolic.workloads.sim.config import SimConfig


@dataclasses.dataclass(frozen=True)
class Simulation:
    equation: str
    mesh: Mesh
    abstract_state: TrainState  # ShapeDtypeStructs with the target shardings (checkpoint restore target)
    initial_state: Callable[[], TrainState]  # compiled; the state is born sharded
    frame_step: Callable[[TrainState, None], tuple[TrainState, dict[str, jax.Array]]]  # jitted, guarded, donating
    measure: Callable[[TrainState], dict[str, jax.Array]]  # the diagnostics of a state (frame 0)
    picture: Callable[[TrainState], jax.Array]  # the physical field to draw, (n, n), sharded (3-D: a plane)
    picture_name: str
    plot_keys: tuple[str, ...]  # diagnostics worth a time-series plot
    dt: float  # the fixed step, or 0 when chosen by the CFL condition
    steps_per_frame: int  # 0 when adaptive
    picture_axes: tuple[str, str] = ("x", "y")  # what the picture's rows and columns run along
    spectrum: Callable[[TrainState], jax.Array] | None = None  # the energy spectrum E(k) of a state, if any


@contextlib.contextmanager
def precision(cfg: SimConfig) -> Iterator[None]:
    """Turns on 64-bit jax for `sim.dtype=float64` while the block runs, restoring the previous setting after.

    A global switch, not a thread-local one: Orbax restores arrays on its own threads and would otherwise
    create float32 arrays from a float64 checkpoint.
    """
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", previous or cfg.sim.dtype == "float64")
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def real_dtype(cfg: SimConfig) -> jnp.dtype:
    dtype = jnp.dtype(cfg.sim.dtype)
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise RuntimeError("sim.dtype=float64 needs 64-bit jax: build the simulation inside `with precision(cfg):`")
    return dtype


def fixed_steps(cfg: SimConfig, dt: float) -> tuple[int, float]:
    """Whole steps per frame for a requested step `dt`, and the step that makes them fit exactly."""
    steps = max(1, math.ceil(cfg.frame_time / dt * (1 - 1e-12)))
    return steps, cfg.frame_time / steps


FIELDS = {"navier_stokes": 1, "navier_stokes_3d": 3, "gray_scott": 2, "heat": 1}  # values per grid point


def grid_bytes(cfg: SimConfig, copies: int = 2) -> int:
    """A lower bound on a run's memory: `copies` of the fields (the state and at least one time-stepping stage)."""
    itemsize = 8 if cfg.sim.dtype == "float64" else 4
    return cfg.grid.n ** cfg.sim.dimensions * FIELDS[cfg.sim.equation] * itemsize * copies


def check_grid_fits(cfg: SimConfig, mesh: Mesh, copies: int = 2) -> None:
    """A UserError, before anything is traced or allocated, when the grid cannot fit in the mesh's memory."""
    n, dims = cfg.grid.n, cfg.sim.dimensions
    memory.check_fits(
        grid_bytes(cfg, copies), list(mesh.devices.flat),
        what=(f"A grid.n={n} grid in {dims} dimensions ({n ** dims:,} points of {cfg.sim.equation}, "
              f"{cfg.sim.dtype}, the fields {copies} times over)"),
        fix=f"lower grid.n (each halving divides the memory by {2 ** dims}), use float32, or use more devices.",
    )


def jit_frame_step(advance: Callable, shardings: TrainState, mesh: Mesh, cfg: SimConfig) -> Callable:
    def frame_step(state: TrainState, batch: None) -> tuple[TrainState, dict[str, jax.Array]]:
        del batch  # the equation makes its own data
        fields, metrics = advance(state.params, state.extra["time"], state.step + 1)
        new = state.replace(step=state.step + 1, params=fields, extra={"time": metrics["time"]})
        return new, metrics

    # Every diagnostic must be finite, and so must the fields (the guard checks the state's params).
    return jit_step(frame_step, state_shardings=shardings, batch_sharding=None, mesh=mesh, loop=cfg.loop, check=None)


def state_shardings(mesh: Mesh, field_shardings: dict[str, NamedSharding]) -> TrainState:
    replicated = NamedSharding(mesh, P())
    return TrainState(step=replicated, params=field_shardings, opt_state={}, rng=replicated,
                      extra={"time": replicated})


def new_state(fields: dict[str, jax.Array], rng: jax.Array, dtype: jnp.dtype) -> TrainState:
    """A simulation's state at frame 0. The fields are its `params`, not its `extra`: they are what every frame
    changes, what the engine's guard checks for NaN and Inf, and what a checkpoint stores as its own item, so run
    directories of every version resume. There is no optimizer: `opt_state` is empty, and the Checkpointer writes
    no item for it (checkpoints from before held a placeholder there, which a restore does not read)."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=fields, opt_state={}, rng=rng,
                      extra={"time": jnp.zeros((), dtype)})


def to_host(x: jax.Array) -> Any:
    """A global array as one NumPy array on every process (an all-gather when several processes share it)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(x, tiled=True)
    return jax.device_get(x)
