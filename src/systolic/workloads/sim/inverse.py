"""The inverse problem: recover the viscosity from observed vorticity snapshots by differentiating the solver.

Observations are the vorticity at every frame of a run with the true viscosity (`navier_stokes.viscosity`),
optionally with noise. The misfit of a candidate viscosity is the mean over frames of the relative squared
L2 distance between its snapshots and the observations; `jax.grad` goes through the whole time integration
(fixed steps, each a `jax.checkpoint`, so the backward pass keeps one field per step) and through the slab
transposes of the sharded solver. The fit itself is an ordinary engine training run over one parameter,
log(viscosity): the engine's train step, optimizer, loop, checkpoints and metrics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.engine.loop import Task
from systolic.optim.adamw import make_optimizer, make_schedule
from systolic.engine.state import TrainState, make_sharded_state
from systolic.engine.step import CHECKED, jit_step, make_train_step
from systolic.errors import ConfigError
from systolic.runtime.cpu_tuning import compile_once
from systolic.workloads.sim import navier_stokes as ns_lib
from systolic.workloads.sim.config import SimConfig
from systolic.workloads.sim.slab import Slab
from systolic.workloads.sim.simulation import check_grid_fits, fixed_steps, real_dtype
from systolic.workloads.sim.solver import make_forcing, make_initial_vorticity, make_slab


def check_fit_config(cfg: SimConfig) -> None:
    if cfg.sim.equation != "navier_stokes" or cfg.sim.dt <= 0:
        raise ConfigError(
            f"`systolic fit sim` differentiates the 2-D Navier-Stokes solver with a fixed time step, but the config "
            f"has sim.equation={cfg.sim.equation} and sim.dt={cfg.sim.dt}. The fit is written for the 2-D vorticity "
            "snapshots (the 3-D solver is differentiable, but no fit uses it), and reverse-mode gradients cannot pass "
            "through the adaptive (CFL) step's data-dependent loop. Fix: sim.equation=navier_stokes and a fixed "
            "step, e.g. sim.dt=0.01, or start from --recipe sim-viscosity-inverse."
        )


@dataclasses.dataclass(frozen=True)
class InverseProblem:
    misfit: Callable[[jax.Array], jax.Array]  # viscosity -> mean relative squared error over the frames (jittable)
    initial_w_hat: jax.Array
    observed: jax.Array  # (frames, n, n/2) spectral snapshots
    true_viscosity: float


def make_trajectory(cfg: SimConfig, slab: Slab, *, remat: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """trajectory(w_hat0, viscosity) -> the (frames, n, n/(2P)) snapshots at the end of every frame; runs
    inside shard_map. Fixed steps in `lax.scan`, so reverse-mode differentiable."""
    dtype = real_dtype(cfg)
    steps, dt = fixed_steps(cfg, cfg.sim.dt)

    def trajectory(w_hat0, viscosity):
        spec = ns_lib.make_spectrum(slab, cfg.grid.length, dtype)
        forcing = make_forcing(cfg, spec)

        def frame(carry, _):
            w, t = carry
            w, t = ns_lib.integrate_fixed(w, t, jnp.asarray(dt, dtype), steps, spec=spec, slab=slab,
                                          viscosity=viscosity, drag=cfg.navier_stokes.drag, forcing=forcing,
                                          remat=remat)
            return (w, t), w

        return lax.scan(frame, (w_hat0, jnp.zeros((), dtype)), length=cfg.output.frames)[1]

    return trajectory


def make_misfit(cfg: SimConfig, mesh: Mesh, *,
                remat: bool = True) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """misfit(w_hat0, viscosity, observed) -> scalar, sharded like the simulation; differentiable in all three."""
    slab = make_slab(cfg, mesh)
    trajectory = make_trajectory(cfg, slab, remat=remat)

    def body(w_hat0, viscosity, observed):
        spec = ns_lib.make_spectrum(slab, cfg.grid.length, real_dtype(cfg))
        snaps = trajectory(w_hat0, viscosity)  # (frames, n, n/(2P))
        err = slab.psum(jnp.sum(spec.parseval * jnp.abs(snaps - observed) ** 2, axis=(1, 2)))  # (frames,)
        norm = slab.psum(jnp.sum(spec.parseval * jnp.abs(observed) ** 2, axis=(1, 2)))
        return jnp.mean(err / norm)

    frames_spec = P(None, *slab.spectral_spec)
    return jax.shard_map(body, mesh=mesh, in_specs=(slab.spectral_spec, P(), frames_spec), out_specs=P())


def make_observations(cfg: SimConfig, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """(initial w_hat, observed snapshots): the truth run from the config's initial condition and viscosity,
    plus `fit.noise` x rms(w) of white noise on every physical snapshot (projected onto the resolved modes).
    Computed once, so compiled at XLA:CPU optimisation level 0 (random numbers are slow to optimise)."""
    slab = make_slab(cfg, mesh)
    dtype = real_dtype(cfg)
    init_key, _ = jax.random.split(jax.random.PRNGKey(cfg.sim.seed))
    noise_key = jax.random.fold_in(jax.random.PRNGKey(cfg.sim.seed), 1)
    initial = make_initial_vorticity(cfg, mesh, slab, init_key)
    frames_spec = P(None, *slab.spectral_spec)
    truth = jax.shard_map(make_trajectory(cfg, slab, remat=False), mesh=mesh,
                          in_specs=(slab.spectral_spec, P()), out_specs=frames_spec)

    def add_noise(snaps, noise):  # noise (frames, n/P, n) physical, unit variance
        spec = ns_lib.make_spectrum(slab, cfg.grid.length, dtype)
        power = slab.psum(jnp.sum(spec.parseval * jnp.abs(snaps) ** 2)) / snaps.shape[0]  # n^4 <w^2>, frame mean
        rms = jnp.sqrt(power) / cfg.grid.n**2
        c = snaps.dtype
        return snaps + (cfg.fit.noise * rms).astype(c) * slab.forward(noise) * spec.dealias.astype(c)

    noisy = jax.shard_map(add_noise, mesh=mesh, in_specs=(frames_spec, P(None, *slab.physical_spec)),
                          out_specs=frames_spec)

    def observe():
        w0 = initial()
        snaps = truth(w0, jnp.asarray(cfg.navier_stokes.viscosity, dtype))
        if cfg.fit.noise > 0:
            snaps = noisy(snaps, jax.random.normal(noise_key, (cfg.output.frames, cfg.grid.n, cfg.grid.n), dtype))
        return w0, snaps

    shardings = (NamedSharding(mesh, slab.spectral_spec), NamedSharding(mesh, frames_spec))
    return compile_once(jax.jit(observe, out_shardings=shardings))()


def make_problem(cfg: SimConfig, mesh: Mesh) -> InverseProblem:
    check_fit_config(cfg)
    check_grid_fits(cfg, mesh, copies=cfg.output.frames + 2)  # the observed snapshots besides the state
    misfit = make_misfit(cfg, mesh)
    w0, observed = make_observations(cfg, mesh)
    return InverseProblem(misfit=lambda viscosity: misfit(w0, viscosity, observed), initial_w_hat=w0,
                          observed=observed, true_viscosity=cfg.navier_stokes.viscosity)


def build_task(cfg: SimConfig, mesh: Mesh) -> tuple[Task, InverseProblem]:
    """The engine Task of the fit: params {"log_viscosity"}, loss = misfit(exp(log_viscosity))."""
    problem = make_problem(cfg, mesh)
    dtype = real_dtype(cfg)
    schedule = make_schedule(cfg.optim, cfg.fit.steps)  # lr(t): the optimizer's and the logged metric's
    tx = make_optimizer(cfg.optim, schedule)
    true_nu = problem.true_viscosity

    def loss_fn(params, batch, key):
        del batch, key  # the observations are fixed; no randomness
        viscosity = jnp.exp(params["log_viscosity"])
        loss = problem.misfit(viscosity)
        return loss, {"viscosity": viscosity, "relative_error": jnp.abs(viscosity / true_nu - 1)}

    def init_state() -> TrainState:
        params = {"log_viscosity": jnp.asarray(math.log(cfg.fit.initial_viscosity), dtype)}
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                          rng=jax.random.PRNGKey(cfg.sim.seed))

    replicated = NamedSharding(mesh, P())
    state = make_sharded_state(init_state, (), lambda shapes: jax.tree.map(lambda _: replicated, shapes))
    step = make_train_step(loss_fn, tx, schedule)
    steps_per_trajectory = cfg.output.frames * fixed_steps(cfg, cfg.sim.dt)[0]
    task = Task(
        workload="sim",
        abstract_state=state.abstract,
        init_state=state.init,
        train_step=jit_step(step, state_shardings=state.shardings, batch_sharding=None, mesh=mesh, loop=cfg.loop,
                            check=CHECKED),
        data=None,
        check=CHECKED,
        nonfinite_advice="lower optim.lr or start nearer the truth (fit.initial_viscosity), then rerun the same "
                         "command to resume",
        items_per_step=steps_per_trajectory,  # solver steps forward (the backward pass repeats them)
        item_unit="sim steps",
        meta={"workload": "sim", "mode": "fit"},
    )
    return task, problem
