"""The `sim` workload's config: the grid, the equation and its parameters, outputs, and the inverse problem.

One loop step of a simulation is one *frame*: the solver advances `sim.t_end / output.frames` in simulated time
(many time steps, one jitted call), then metrics, a snapshot and possibly a checkpoint are written. So
`checkpoint.every_steps` and `observe.log_every` count frames.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from systolic.config import (CheckpointConfig, LoopConfig, MeshConfig, ObserveConfig, OptimConfig, check_positive,
                             check_seed)
from systolic.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """A periodic square (2-D equations) or cube (navier_stokes_3d) of side `length`, n points a side (spacing
    length / n)."""

    n: int = 256
    length: float = 2 * math.pi

    @property
    def dx(self) -> float:
        return self.length / self.n

    def validate(self) -> None:
        if self.n < 8 or self.n % 2:
            raise ConfigError(
                f"grid.n={self.n} is not a usable grid size. Expected an even number >= 8 (the spectral solver "
                "keeps n/2 wavenumbers per row and splits them over the devices). Fix: e.g. grid.n=256."
            )
        check_positive(self, "grid", ("length",))


@dataclasses.dataclass(frozen=True)
class SimSettings:
    """Which equation, how long, and how the time step is chosen.

    `dt` = 0 picks the step automatically: for Navier-Stokes from the advective CFL condition every step
    (dt = cfl * dx / max(|u| + |v|), + |w| in 3-D); for the finite-difference equations as `cfl` times the explicit Euler
    diffusion limit dx^2 / (4 D). A fixed `dt` > 0 is rounded down so each frame is a whole number of steps;
    a fixed step is required for `systolic fit` (gradients cannot flow through a data-dependent step count).
    """

    equation: Literal["navier_stokes", "navier_stokes_3d", "gray_scott", "heat"] = "navier_stokes"
    t_end: float = 10.0
    dt: float = 0.0
    cfl: float = 0.5
    dtype: Literal["float32", "float64"] = "float32"
    seed: int = 0

    @property
    def solver(self) -> Literal["spectral", "spectral pencils", "fd"]:
        return {"navier_stokes": "spectral", "navier_stokes_3d": "spectral pencils"}.get(self.equation, "fd")

    @property
    def dimensions(self) -> int:
        return 3 if self.equation == "navier_stokes_3d" else 2

    def validate(self) -> None:
        check_seed("sim.seed", self.seed)
        if not self.t_end > 0 or self.dt < 0 or not 0 < self.cfl <= 1:
            raise ConfigError(
                f"sim.t_end={self.t_end}, sim.dt={self.dt}, sim.cfl={self.cfl}: expected t_end > 0, dt >= 0 "
                "(0 = choose from the CFL/stability condition) and 0 < cfl <= 1. Fix: e.g. sim.t_end=10 sim.dt=0 "
                "sim.cfl=0.5."
            )


@dataclasses.dataclass(frozen=True)
class NavierStokesConfig:
    """2-D incompressible flow in vorticity form: w_t + u . grad w = viscosity lap w - drag w + forcing.

    `initial`: `random` draws a field whose energy spectrum peaks at `initial_wavenumber` (in units of 2 pi /
    length) with mean kinetic energy `initial_energy`; `taylor_green` is the exact decaying vortex array
    u = U cos(kx) sin(ky), v = -U sin(kx) cos(ky) with k = `initial_wavenumber` and U = 2 sqrt(initial_energy).
    `forcing=kolmogorov` adds `forcing_amplitude * cos(k_f y)` to the vorticity equation (k_f = forcing_wavenumber).
    """

    viscosity: float = 1e-4
    drag: float = 0.0
    initial: Literal["random", "taylor_green"] = "random"
    initial_wavenumber: int = 6
    initial_energy: float = 0.5
    forcing: Literal["none", "kolmogorov"] = "none"
    forcing_amplitude: float = 1.0
    forcing_wavenumber: int = 4

    def validate(self) -> None:
        if self.viscosity < 0 or self.drag < 0 or not self.initial_energy > 0:
            raise ConfigError(
                f"navier_stokes.viscosity={self.viscosity}, drag={self.drag}, initial_energy={self.initial_energy}: "
                "expected viscosity >= 0 (0 = inviscid), drag >= 0 and initial_energy > 0. Fix the negative value."
            )
        if self.initial_wavenumber < 1 or self.forcing_wavenumber < 1:
            raise ConfigError(
                f"navier_stokes.initial_wavenumber={self.initial_wavenumber} and forcing_wavenumber="
                f"{self.forcing_wavenumber} must be integers >= 1 (multiples of 2 pi / grid.length). Fix: e.g. 4."
            )


@dataclasses.dataclass(frozen=True)
class NavierStokes3DConfig:
    """3-D incompressible flow in velocity form on the periodic cube: u_t + u . grad u = -grad p + viscosity lap u.

    `initial`: `taylor_green` is u = V sin(kx) cos(ky) cos(kz), v = -V cos(kx) sin(ky) cos(kz), w = 0 with V =
    `velocity`, k = `initial_wavenumber` (in units of 2 pi / length); with k = 1 on [0, 2 pi)^3 its Reynolds number is
    V / (k viscosity): 1600 for the standard benchmark (viscosity 1/1600 = 0.000625). `abc` is the
    Arnold-Beltrami-Childress flow with A = B = C = V at wavenumber k, an exact solution that decays as
    exp(-viscosity k^2 t) without changing shape; the run then reports its error against that.
    """

    viscosity: float = 6.25e-4
    initial: Literal["taylor_green", "abc"] = "taylor_green"
    initial_wavenumber: int = 1
    velocity: float = 1.0

    def validate(self) -> None:
        if self.viscosity < 0 or not self.velocity > 0 or self.initial_wavenumber < 1:
            raise ConfigError(
                f"navier_stokes_3d.viscosity={self.viscosity}, velocity={self.velocity}, initial_wavenumber="
                f"{self.initial_wavenumber}: expected viscosity >= 0 (0 = inviscid), velocity > 0 and an integer "
                "wavenumber >= 1 (a multiple of 2 pi / grid.length). Fix: e.g. navier_stokes_3d.viscosity=0.000625 "
                "navier_stokes_3d.velocity=1 navier_stokes_3d.initial_wavenumber=1."
            )


@dataclasses.dataclass(frozen=True)
class GrayScottConfig:
    """Reaction-diffusion u_t = Du lap u - u v^2 + F (1 - u), v_t = Dv lap v + u v^2 - (F + k) v.

    Starts from u = 1, v = 0 with `spots` random squares of u = 0.5, v = 0.25 plus 1% noise (Pearson 1993).
    """

    feed: float = 0.0367
    kill: float = 0.0649
    diffusion_u: float = 2e-5
    diffusion_v: float = 1e-5
    spots: int = 12

    def validate(self) -> None:
        if min(self.feed, self.kill) < 0 or not (self.diffusion_u > 0 and self.diffusion_v > 0) or self.spots < 1:
            raise ConfigError(
                f"gray_scott.feed={self.feed}, kill={self.kill}, diffusion_u={self.diffusion_u}, diffusion_v="
                f"{self.diffusion_v}, spots={self.spots}: expected feed, kill >= 0, positive diffusion "
                "coefficients and at least one spot. Fix: e.g. gray_scott.feed=0.0367 gray_scott.kill=0.0649."
            )


@dataclasses.dataclass(frozen=True)
class HeatConfig:
    """u_t = diffusivity lap u from u0 = sin(mx x') sin(my y') (x' = 2 pi x / length): exact solution known."""

    diffusivity: float = 0.1
    mode_x: int = 1
    mode_y: int = 2

    def validate(self) -> None:
        if not self.diffusivity > 0 or self.mode_x < 0 or self.mode_y < 0:
            raise ConfigError(
                f"heat.diffusivity={self.diffusivity}, mode_x={self.mode_x}, mode_y={self.mode_y}: expected a "
                "positive diffusivity and non-negative integer modes. Fix: e.g. heat.diffusivity=0.1 heat.mode_x=1."
            )


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    """Frames split the run into equal intervals of simulated time; each writes metrics and a snapshot."""

    frames: int = 50
    images: bool = True  # final.png, animation.gif, diagnostics.png
    image_pixels: int = 256  # snapshots (and GIF frames) are subsampled to at most this many pixels a side
    colormap: str = ""  # empty: RdBu_r for vorticity, viridis for concentration and temperature

    def validate(self) -> None:
        if self.frames < 1 or self.image_pixels < 8:
            raise ConfigError(
                f"output.frames={self.frames} and output.image_pixels={self.image_pixels}: expected frames >= 1 and "
                "image_pixels >= 8. Fix: e.g. output.frames=50 output.image_pixels=256."
            )


@dataclasses.dataclass(frozen=True)
class FitConfig:
    """`systolic fit sim`: recover navier_stokes.viscosity (the truth that makes the observations) by gradient
    descent on log(viscosity) from `initial_viscosity`, matching every frame's vorticity snapshot."""

    initial_viscosity: float = 3e-2
    steps: int = 100
    noise: float = 0.0  # observation noise, as a fraction of the snapshots' rms vorticity

    def validate(self) -> None:
        if not self.initial_viscosity > 0 or self.steps < 1 or self.noise < 0:
            raise ConfigError(
                f"fit.initial_viscosity={self.initial_viscosity}, steps={self.steps}, noise={self.noise}: expected "
                "initial_viscosity > 0, steps >= 1, noise >= 0. Fix: e.g. fit.initial_viscosity=0.03 fit.steps=100."
            )


@dataclasses.dataclass(frozen=True)
class SimConfig:
    workload: Literal["sim"] = "sim"
    grid: GridConfig = GridConfig()
    sim: SimSettings = SimSettings()
    navier_stokes: NavierStokesConfig = NavierStokesConfig()
    navier_stokes_3d: NavierStokes3DConfig = NavierStokes3DConfig()
    gray_scott: GrayScottConfig = GrayScottConfig()
    heat: HeatConfig = HeatConfig()
    output: OutputConfig = OutputConfig()
    fit: FitConfig = FitConfig()
    optim: OptimConfig = OptimConfig(lr=0.05, warmup_steps=0, weight_decay=0.0, min_lr_ratio=0.1)
    mesh: MeshConfig = MeshConfig()
    loop: LoopConfig = LoopConfig()
    checkpoint: CheckpointConfig = CheckpointConfig(every_steps=10)
    observe: ObserveConfig = ObserveConfig(log_every=1)

    @property
    def frame_time(self) -> float:
        """Simulated time between frames."""
        return self.sim.t_end / self.output.frames

    def validate(self) -> None:
        ns, n = self.navier_stokes, self.grid.n
        if self.sim.equation == "navier_stokes":
            # The 2/3 rule keeps |k| < n/3; a mode above that is removed before the first step.
            for name in ("initial_wavenumber", "forcing_wavenumber"):
                if 3 * getattr(ns, name) >= n:
                    raise ConfigError(
                        f"navier_stokes.{name}={getattr(ns, name)} is not resolved on grid.n={n}: dealiasing keeps "
                        f"wavenumbers below n/3 = {n / 3:.1f}. Fix: lower it or raise grid.n above "
                        f"{3 * getattr(ns, name)}."
                    )
        elif self.sim.equation == "navier_stokes_3d":
            k = self.navier_stokes_3d.initial_wavenumber
            if 3 * k >= n:
                raise ConfigError(
                    f"navier_stokes_3d.initial_wavenumber={k} is not resolved on grid.n={n}: dealiasing keeps "
                    f"wavenumbers below n/3 = {n / 3:.1f}. Fix: lower it or raise grid.n above {3 * k}."
                )
        elif self.sim.dt > 0:
            limit = self.grid.dx ** 2 / (4 * self.max_diffusivity)
            if self.sim.dt > limit:
                raise ConfigError(
                    f"sim.dt={self.sim.dt} exceeds the explicit Euler stability limit dx^2 / (4 D) = {limit:.4g} for "
                    f"{self.sim.equation} on grid.n={n}, grid.length={self.grid.length}; the solution would blow up. "
                    f"Fix: sim.dt=0 (choose automatically) or sim.dt <= {limit:.4g}."
                )

    @property
    def max_diffusivity(self) -> float:
        if self.sim.equation == "gray_scott":
            return max(self.gray_scott.diffusion_u, self.gray_scott.diffusion_v)
        if self.sim.equation == "heat":
            return self.heat.diffusivity
        return self.navier_stokes.viscosity
