"""systolic: one JAX training stack for language models, RL, GANs and scientific simulation.

Importing it sets one thing, and only on a host with no accelerator device files: JAX_PLATFORMS=cpu (unless the user
chose a platform), so that a script of one's own that imports systolic starts jax as quietly as the CLI does (with
libtpu installed, jax would otherwise probe for a TPU and print libtpu's errors about not finding one). Nothing else
changes (XLA_FLAGS included); the CLI applies the CPU tuning at start (runtime/cpu_tuning.py).
"""

from systolic.runtime.startup import cpu_only_host

cpu_only_host()
