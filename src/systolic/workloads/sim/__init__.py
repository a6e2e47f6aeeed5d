"""The `sim` workload: sharded, differentiable PDE solvers on the engine's mesh, checkpoints and metrics.

config.py (schema) -> solver.py (config + mesh -> sharded state and a jitted frame step) built from
navier_stokes.py + slab.py (spectral, slab-decomposed FFTs) and finite_difference.py (halo exchange);
the engine's loop runs the frames (entry.simulation_task), outputs.py draws them, inverse.py fits the viscosity, entry.py is what the CLI calls.
"""
