"""Splash attention: JAX's own Pallas kernel for training's attention (jax.experimental.pallas.ops.tpu), so this
family holds only its tiles measured per chip and head width (tuned_block_sizes.py). The wrapper that calls it under
a mesh, beside the plain formulations it must equal, is lm/model/attention.py (it tags the kernel's residuals with
the model's remat names); its tests: tests/workloads/lm/test_attention.py and tests/tpu/test_splash.py."""
