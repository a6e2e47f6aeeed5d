"""Pallas kernels, each beside the plain-JAX formulation it must equal (its reference) and its tuned block sizes:
paged_attention (serving's attention over the paged KV pool). Training's splash attention is JAX's own kernel,
wrapped in lm/model/attention.py with its tuned tiles in lm/model/splash_blocks.py."""
