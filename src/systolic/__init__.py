"""systolic: one JAX training stack for language models, RL, GANs and scientific simulation."""

from systolic.runtime import cpu_flags as _cpu_flags

_cpu_flags.apply()  # before JAX creates its CPU client
