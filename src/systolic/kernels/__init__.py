"""Kernel families, each in a package with the plain-JAX reference it must equal (or, for JAX's own kernels, the
wrapper's) and its block sizes measured per chip and head width: paged_attention (serving's attention over the paged
KV pool and the pool's int8 writes by DMA), splash (training's attention: JAX's kernel, its tiles). Kernels import
jax and the runtime, nothing above: the lm model and its server both import them."""
