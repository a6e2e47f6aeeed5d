"""Paged attention, one kernel family below both the lm model and its serving engine (as tpu-inference keeps
kernels/ragged_paged_attention/): the Pallas kernel (kernel.py) and the DMA writer of an int8 pool (kv_write.py),
each beside its plain-JAX reference (reference.py); the pool's layout (pool.py, int8_pool.py) and a step's
metadata (metadata.py); the op the model's attention calls, which picks kernel or reference (paged_kv.py); the
block sizes measured per chip and head width (tuned_block_sizes.py). Tests: tests/kernels/paged_attention/;
microbenchmarks: benchmarks/kernels/; design and measurements: docs/paged-attention.md."""

# How the pool stores keys and values: the compute dtype, or int8 with scales (int8_pool.py). Here, not in pool.py,
# so that the command line declares `--kv-cache` without importing jax.
KV_CACHES = ("auto", "int8")
