"""The `sim` workload: sharded, differentiable PDE solvers on the engine's mesh, checkpoints and metrics.

config.py (schema) -> solver.py (config + mesh -> simulation.py's `Simulation`: a sharded state and a jitted
frame step) built from navier_stokes.py + slab.py (2-D spectral, slab-decomposed FFTs) and finite_difference.py
(halo exchange); solver_3d.py does the same for 3-D turbulence from navier_stokes_3d.py + pencil.py
(pencil-decomposed FFTs over a 2-D mesh); time_stepping.py is the integrating-factor RK4 both spectral solvers
share. The engine's loop runs the frames (entry.simulation_task), outputs.py draws them, taylor_green.py compares
the 3-D Taylor-Green run with the published curve, inverse.py fits the viscosity, entry.py is what the CLI calls.
"""
