"""From a config and a mesh to a runnable simulation (simulation.py's `Simulation`): `make_simulation` picks the
solver, and the 2-D ones are here, the pseudo-spectral Navier-Stokes solver on slabs and the finite-difference
solvers (heat, Gray-Scott) on blocks; 3-D turbulence is solver_3d.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.engine.state import TrainState, make_sharded_state
from systolic.errors import ConfigError
from systolic.runtime import mesh as mesh_lib
from systolic.workloads.sim import finite_difference as fd
from systolic.workloads.sim import navier_stokes as ns_lib
from systolic.workloads.sim import time_stepping
from systolic.workloads.sim.config import SimConfig
from systolic.workloads.sim.simulation import (Simulation, check_grid_fits, fixed_steps, jit_frame_step, new_state,
                                               real_dtype, state_shardings)
from systolic.workloads.sim.slab import Slab, pairs_real_transforms
from systolic.workloads.sim.solver_3d import make_turbulence

def make_simulation(cfg: SimConfig, mesh: Mesh) -> Simulation:
    """The simulation `sim.equation` names on `mesh`, after checking that its grid fits in the mesh's memory."""
    check_grid_fits(cfg, mesh)
    if cfg.sim.equation == "navier_stokes_3d":
        return make_turbulence(cfg, mesh)
    if cfg.sim.solver == "spectral":
        return _navier_stokes(cfg, mesh)
    return _finite_difference(cfg, mesh)


# SPECTRAL NAVIER-STOKES ---------------------------------------------------------------------------------------


def make_slab(cfg: SimConfig, mesh: Mesh) -> Slab:
    n, parts = cfg.grid.n, mesh.size
    if n % (2 * parts):
        good = 2 * parts * max(1, round(n / (2 * parts)))
        raise ConfigError(
            f"grid.n={n} cannot be split into {parts} slabs: the spectral solver splits the n grid rows and the n/2 "
            f"kept wavenumbers over all {parts} devices, so n must be a multiple of 2 x {parts} = {2 * parts}. "
            f"Fix: grid.n={good} (any multiple of {2 * parts})."
        )
    # every mesh axis, flattened: one slab per device; on TPUs the y passes paired (slab.py: a third fewer FLOPs)
    return Slab(n, mesh_lib.AXES, parts, pair_real_transforms=pairs_real_transforms(mesh))


def make_forcing(cfg: SimConfig, spec: ns_lib.Spectrum) -> ns_lib.Forcing | None:
    ns = cfg.navier_stokes
    if ns.forcing == "none":
        return None
    f_hat = ns_lib.kolmogorov_hat(spec, cfg.grid.n, ns.forcing_wavenumber, ns.forcing_amplitude)
    return lambda t: f_hat


def make_initial_vorticity(cfg: SimConfig, mesh: Mesh, slab: Slab, key: jax.Array) -> Callable[[], jax.Array]:
    """A function (to call under jit) returning w_hat at t = 0 in the spectral layout."""
    ns, n, dtype = cfg.navier_stokes, cfg.grid.n, real_dtype(cfg)

    if ns.initial == "taylor_green":
        def body():
            spec = ns_lib.make_spectrum(slab, cfg.grid.length, dtype)
            w_hat = ns_lib.taylor_green_hat(spec, n, cfg.grid.length, ns.initial_wavenumber,
                                            2 * math.sqrt(ns.initial_energy))
            return w_hat * spec.dealias.astype(w_hat.dtype)

        return jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=slab.spectral_spec)

    def shape(noise):
        spec = ns_lib.make_spectrum(slab, cfg.grid.length, dtype)
        return ns_lib.random_vorticity_hat(slab.forward(noise), spec, slab, ns.initial_wavenumber, ns.initial_energy)

    shaped = jax.shard_map(shape, mesh=mesh, in_specs=slab.physical_spec, out_specs=slab.spectral_spec)
    # Drawn on the global grid, so every mesh gets the same field.
    return lambda: shaped(jax.lax.with_sharding_constraint(
        jax.random.normal(key, (n, n), dtype), NamedSharding(mesh, slab.physical_spec)))


def _navier_stokes(cfg: SimConfig, mesh: Mesh) -> Simulation:
    ns, grid = cfg.navier_stokes, cfg.grid
    slab = make_slab(cfg, mesh)
    dtype = real_dtype(cfg)
    steps, dt = fixed_steps(cfg, cfg.sim.dt) if cfg.sim.dt > 0 else (0, 0.0)
    exact = ns.initial == "taylor_green" and ns.forcing == "none"
    tg_rate = 2 * ns.viscosity * (2 * math.pi * ns.initial_wavenumber / grid.length) ** 2 + ns.drag

    def diagnostics(w_hat, t, spec):
        energy, enstrophy = ns_lib.energy_enstrophy(w_hat, spec, slab)
        out = {"time": t, "energy": energy, "enstrophy": enstrophy}
        if exact:  # Taylor-Green decays as exp(-(2 nu k^2 + alpha) t) without changing shape
            ref = ns_lib.taylor_green_hat(spec, grid.n, grid.length, ns.initial_wavenumber,
                                          2 * math.sqrt(ns.initial_energy))
            ref = ref * time_stepping.exp(-tg_rate * t).astype(ref.dtype)
            out["error"] = ns_lib.relative_l2(w_hat, ref, spec, slab)
        return out

    def advance_body(fields, t, frame):
        spec = ns_lib.make_spectrum(slab, grid.length, dtype)
        forcing = make_forcing(cfg, spec)
        t_stop = frame.astype(dtype) * cfg.frame_time
        kw = dict(spec=spec, slab=slab, viscosity=ns.viscosity, drag=ns.drag, forcing=forcing)
        if steps:
            w_hat, _ = ns_lib.integrate_fixed(fields["w_hat"], t, jnp.asarray(dt, dtype), steps, **kw)
            count = jnp.asarray(steps, jnp.int32)
        else:
            w_hat, _, count = ns_lib.integrate_cfl(fields["w_hat"], t, t_stop, cfl=cfg.sim.cfl, dx=grid.dx,
                                                   dt_max=cfg.frame_time, **kw)
        mean_dt = cfg.frame_time / count.astype(dtype)
        return {"w_hat": w_hat}, {"steps": count, "dt": mean_dt, **diagnostics(w_hat, t_stop, spec)}

    field_spec = {"w_hat": slab.spectral_spec}
    advance = jax.shard_map(advance_body, mesh=mesh, in_specs=(field_spec, P(), P()), out_specs=(field_spec, P()))
    measure_map = jax.shard_map(lambda f, t: diagnostics(f["w_hat"], t, ns_lib.make_spectrum(slab, grid.length, dtype)),
                                mesh=mesh, in_specs=(field_spec, P()), out_specs=P())
    to_physical = jax.shard_map(slab.inverse, mesh=mesh, in_specs=slab.spectral_spec, out_specs=slab.physical_spec)

    init_key, rng = jax.random.split(jax.random.PRNGKey(cfg.sim.seed))
    initial_w = make_initial_vorticity(cfg, mesh, slab, init_key)
    shardings = state_shardings(mesh, {"w_hat": NamedSharding(mesh, slab.spectral_spec)})

    def init() -> TrainState:
        return new_state({"w_hat": initial_w()}, rng, dtype)

    state = make_sharded_state(init, (), lambda _: shardings)
    return Simulation(
        equation="navier_stokes", mesh=mesh, abstract_state=state.abstract, initial_state=state.init,
        frame_step=jit_frame_step(advance, shardings, mesh, cfg),
        measure=jax.jit(lambda s: measure_map(s.params, s.extra["time"])),
        picture=jax.jit(lambda s: to_physical(s.params["w_hat"])),
        picture_name="vorticity", plot_keys=("energy", "enstrophy") + (("error",) if exact else ()),
        dt=dt, steps_per_frame=steps,
    )


# FINITE DIFFERENCES -------------------------------------------------------------------------------------------


def make_blocks(cfg: SimConfig, mesh: Mesh) -> fd.Blocks:
    parts = (math.prod(mesh.shape[a] for a in fd.BLOCK_AXES[0]), math.prod(mesh.shape[a] for a in fd.BLOCK_AXES[1]))
    n = cfg.grid.n
    for axis, p in enumerate(parts):
        if n % p:
            names = " x ".join(f"mesh.{a}" for a in fd.BLOCK_AXES[axis])
            raise ConfigError(
                f"grid.n={n} cannot be split into {p} blocks along grid axis {axis} ({names}): the finite-difference "
                f"solver gives every device an equal block. Fix: grid.n={p * max(1, round(n / p))}, or change the mesh."
            )
    return fd.Blocks(n, fd.BLOCK_AXES, parts)


def heat_initial(i: jax.Array, j: jax.Array, cfg: SimConfig) -> jax.Array:
    """u0 = sin(kx x + 0.5) sin(ky y + 0.25) at grid indices (i, j): an eigenfunction of the Laplacian, so the
    exact solution is u0 exp(-D (kx^2 + ky^2) t). The phases keep it clear of grid symmetries."""
    scale = 2 * math.pi / cfg.grid.length
    x, y = i * cfg.grid.dx, j * cfg.grid.dx
    return jnp.sin(scale * cfg.heat.mode_x * x + 0.5) * jnp.sin(scale * cfg.heat.mode_y * y + 0.25)


def gray_scott_initial(key: jax.Array, cfg: SimConfig, dtype: jnp.dtype) -> dict[str, jax.Array]:
    """u = 1, v = 0, except `spots` random squares (side n/16) of u = 0.5, v = 0.25; 1% multiplicative noise."""
    n, spots = cfg.grid.n, cfg.gray_scott.spots
    k_centre, k_u, k_v = jax.random.split(key, 3)
    centres = jax.random.randint(k_centre, (spots, 2), 0, n)
    half = max(1, n // 32)
    idx = jnp.arange(n)
    dist_i = jnp.abs((idx[None, :] - centres[:, :1] + n // 2) % n - n // 2)  # (spots, n) periodic distance
    dist_j = jnp.abs((idx[None, :] - centres[:, 1:] + n // 2) % n - n // 2)
    inside = jnp.any((dist_i[:, :, None] <= half) & (dist_j[:, None, :] <= half), axis=0)  # (n, n)
    u = jnp.where(inside, 0.5, 1.0).astype(dtype) * (1 + 0.01 * jax.random.normal(k_u, (n, n), dtype))
    v = jnp.where(inside, 0.25, 0.0).astype(dtype) * (1 + 0.01 * jax.random.normal(k_v, (n, n), dtype))
    return {"u": u, "v": v}


def explicit_dt(cfg: SimConfig) -> float:
    """The requested step, or cfl x the explicit Euler diffusion limit dx^2 / (4 D)."""
    return cfg.sim.dt if cfg.sim.dt > 0 else cfg.sim.cfl * cfg.grid.dx ** 2 / (4 * cfg.max_diffusivity)


def _finite_difference(cfg: SimConfig, mesh: Mesh) -> Simulation:
    blocks = make_blocks(cfg, mesh)
    dtype = real_dtype(cfg)
    n, dx = cfg.grid.n, cfg.grid.dx
    steps, dt = fixed_steps(cfg, explicit_dt(cfg))
    init_key, rng = jax.random.split(jax.random.PRNGKey(cfg.sim.seed))

    if cfg.sim.equation == "heat":
        names = ("u",)
        step_fn = partial(fd.heat_step, diffusivity=cfg.heat.diffusivity, blocks=blocks, dx=dx)
        scale = 2 * math.pi / cfg.grid.length
        rate = cfg.heat.diffusivity * scale**2 * (cfg.heat.mode_x**2 + cfg.heat.mode_y**2)

        def initial_fields():
            idx = jnp.arange(n, dtype=dtype)
            return {"u": heat_initial(idx[:, None], idx[None, :], cfg).astype(dtype)}

        def diagnostics(fields, t):
            u = fields["u"]
            i0, j0 = blocks.block_origin()
            # int32 like the origins (lax.axis_index), also when 64-bit jax makes arange int64 by default.
            i = (i0 + jnp.arange(u.shape[0], dtype=jnp.int32)).astype(dtype)[:, None]
            j = (j0 + jnp.arange(u.shape[1], dtype=jnp.int32)).astype(dtype)[None, :]
            exact = heat_initial(i, j, cfg) * time_stepping.exp(-rate * t)
            err = jnp.sqrt(blocks.psum(jnp.sum((u - exact) ** 2)) / blocks.psum(jnp.sum(exact**2)))
            return {"time": t, "mean": blocks.psum(jnp.sum(u)) / n**2, "max": blocks.pmax(jnp.max(jnp.abs(u))),
                    "error": err}

        picture_name, plot_keys = "temperature", ("max", "error")
    else:
        gs = cfg.gray_scott
        names = ("u", "v")
        step_fn = partial(fd.gray_scott_step, feed=gs.feed, kill=gs.kill, diffusion_u=gs.diffusion_u,
                          diffusion_v=gs.diffusion_v, blocks=blocks, dx=dx)

        def initial_fields():
            return gray_scott_initial(init_key, cfg, dtype)

        def diagnostics(fields, t):
            return {"time": t, "mean_u": blocks.psum(jnp.sum(fields["u"])) / n**2,
                    "mean_v": blocks.psum(jnp.sum(fields["v"])) / n**2, "max_v": blocks.pmax(jnp.max(fields["v"]))}

        picture_name, plot_keys = "v concentration", ("mean_u", "mean_v", "max_v")

    def advance_body(fields, t, frame):
        stacked = jnp.stack([fields[k] for k in names])  # (fields, rows, cols): one halo exchange for all
        stacked = fd.integrate(stacked, jnp.asarray(dt, dtype), steps, step_fn)
        out = {k: stacked[i] for i, k in enumerate(names)}
        t_stop = frame.astype(dtype) * cfg.frame_time
        return out, {"steps": jnp.asarray(steps, jnp.int32), "dt": jnp.asarray(dt, dtype), **diagnostics(out, t_stop)}

    field_spec = {k: blocks.spec for k in names}
    advance = jax.shard_map(advance_body, mesh=mesh, in_specs=(field_spec, P(), P()), out_specs=(field_spec, P()))
    measure_map = jax.shard_map(diagnostics, mesh=mesh, in_specs=(field_spec, P()), out_specs=P())
    shardings = state_shardings(mesh, {k: NamedSharding(mesh, blocks.spec) for k in names})

    def init() -> TrainState:
        return new_state(initial_fields(), rng, dtype)

    shown = names[-1]
    state = make_sharded_state(init, (), lambda _: shardings)
    return Simulation(
        equation=cfg.sim.equation, mesh=mesh, abstract_state=state.abstract, initial_state=state.init,
        frame_step=jit_frame_step(advance, shardings, mesh, cfg),
        measure=jax.jit(lambda s: measure_map(s.params, s.extra["time"])),
        picture=jax.jit(lambda s: s.params[shown]),
        picture_name=picture_name, plot_keys=plot_keys, dt=dt, steps_per_frame=steps,
    )

