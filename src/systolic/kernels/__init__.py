"""Pallas kernels, each beside the plain-JAX formulation it must equal (its reference) and its tuned block sizes:
paged_attention (serving's attention over the paged KV pool), kv_write (a step's keys and values written
into an int8 pool by DMA). Training's splash attention is JAX's own kernel,
wrapped in lm/model/attention.py with its tuned tiles in lm/model/splash_blocks.py."""
