"""From a config and a mesh to a runnable 3-D turbulence simulation (`sim.equation=navier_stokes_3d`).

The same contract as the 2-D solvers (simulation.py's `Simulation`): a sharded initial state and one jitted frame
step for the engine's loop, plus what only 3-D has: the energy spectrum E(k) of each frame, and a plane of the
vorticity magnitude as the picture (x = length / 2, the workshop's x = -pi face of [-pi, pi)^3, moved by the period).
The velocity lives in the pencil's spectral layout, split over both axes of the 2-D device mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.engine.state import TrainState, make_sharded_state
from systolic.workloads.sim import navier_stokes_3d as ns3
from systolic.workloads.sim import time_stepping
from systolic.workloads.sim.config import SimConfig
from systolic.workloads.sim.pencil import make_pencil
from systolic.workloads.sim.simulation import (Simulation, fixed_steps, jit_frame_step, new_state, real_dtype,
                                               state_shardings)


def make_turbulence(cfg: SimConfig, mesh: Mesh) -> Simulation:
    flow, grid = cfg.navier_stokes_3d, cfg.grid
    pencil = make_pencil(grid.n, mesh)
    dtype = real_dtype(cfg)
    steps, dt = fixed_steps(cfg, cfg.sim.dt) if cfg.sim.dt > 0 else (0, 0.0)
    exact = flow.initial == "abc"
    abc_rate = flow.viscosity * (2 * math.pi * flow.initial_wavenumber / grid.length) ** 2

    def spectrum():
        return ns3.make_spectrum(pencil, grid.length, dtype)

    def initial(spec):
        return ns3.initial_velocity_hat(flow.initial, pencil, spec, length=grid.length, mode=flow.initial_wavenumber,
                                        velocity=flow.velocity, dtype=dtype)

    def diagnostics(u_hat, t, spec):
        out = {"time": t, **ns3.diagnostics(u_hat, spec, pencil, flow.viscosity)}
        if exact:  # the ABC flow decays as exp(-nu k^2 t) without changing shape
            reference = initial(spec)
            decayed = reference * time_stepping.exp(-abc_rate * t).astype(reference.dtype)
            out["error"] = ns3.relative_l2(u_hat, decayed, spec, pencil)
        return out

    def advance_body(fields, t, frame):
        spec = spectrum()
        t_stop = frame.astype(dtype) * cfg.frame_time
        if steps:
            u_hat, _ = ns3.integrate_fixed(fields["u_hat"], t, jnp.asarray(dt, dtype), steps, spec=spec,
                                           pencil=pencil, viscosity=flow.viscosity)
            count = jnp.asarray(steps, jnp.int32)
        else:
            u_hat, _, count = ns3.integrate_cfl(fields["u_hat"], t, t_stop, cfl=cfg.sim.cfl, dx=grid.dx,
                                                dt_max=cfg.frame_time, spec=spec, pencil=pencil,
                                                viscosity=flow.viscosity)
        mean_dt = cfg.frame_time / count.astype(dtype)
        return {"u_hat": u_hat}, {"steps": count, "dt": mean_dt, **diagnostics(u_hat, t_stop, spec)}

    velocity_spec = P(None, *pencil.spectral_spec)  # (component, kx, ky, kz)
    field_spec = {"u_hat": velocity_spec}
    advance = jax.shard_map(advance_body, mesh=mesh, in_specs=(field_spec, P(), P()), out_specs=(field_spec, P()))
    measure_map = jax.shard_map(lambda f, t: diagnostics(f["u_hat"], t, spectrum()), mesh=mesh,
                                in_specs=(field_spec, P()), out_specs=P())
    spectrum_map = jax.shard_map(lambda f: ns3.energy_spectrum(f["u_hat"], spectrum(), pencil), mesh=mesh,
                                 in_specs=(field_spec,), out_specs=P())
    vorticity_map = jax.shard_map(lambda u_hat: ns3.vorticity_magnitude(u_hat, spectrum(), pencil), mesh=mesh,
                                  in_specs=velocity_spec, out_specs=pencil.physical_spec)
    initial_map = jax.shard_map(lambda: initial(spectrum()), mesh=mesh, in_specs=(), out_specs=velocity_spec)

    _, rng = jax.random.split(jax.random.PRNGKey(cfg.sim.seed))
    shardings = state_shardings(mesh, {"u_hat": NamedSharding(mesh, velocity_spec)})

    def init() -> TrainState:
        return new_state({"u_hat": initial_map()}, rng, dtype)

    state = make_sharded_state(init, (), lambda _: shardings)
    return Simulation(
        equation="navier_stokes_3d", mesh=mesh, abstract_state=state.abstract, initial_state=state.init,
        frame_step=jit_frame_step(advance, shardings, mesh, cfg),
        measure=jax.jit(lambda s: measure_map(s.params, s.extra["time"])),
        # The plane x = length / 2: one row of pencils holds it; XLA moves only that (n, n) plane.
        picture=jax.jit(lambda s: vorticity_map(s.params["u_hat"])[grid.n // 2]),
        picture_name="vorticity magnitude", picture_axes=("y", "z"),
        plot_keys=("energy", "dissipation") + (("error",) if exact else ("divergence",)),
        dt=dt, steps_per_frame=steps, spectrum=jax.jit(lambda s: spectrum_map(s.params)),
    )
