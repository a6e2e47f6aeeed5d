"""systolic: one JAX training stack for language models, RL, GANs and scientific simulation.

Importing it changes nothing in the process (XLA_FLAGS included); the CLI applies the CPU tuning at start
(runtime/cpu_tuning.py).
"""
