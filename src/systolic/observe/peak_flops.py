"""Peak FLOP/s of known chips, for model FLOPs utilisation (MFU).

MFU = model FLOPs per second / the chip's peak dense FLOP/s. Model FLOPs count each matmul of the model once
(no rematerialisation, no hardware inflation), so MFU is comparable across configurations.
"""

from __future__ import annotations

import jax

# Peak dense FLOP/s per chip from the vendors' data sheets: (bfloat16, float32). float32 on NVIDIA is non-TF32.
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "TPU v4": (275e12, 275e12 / 2),
    "TPU v5 lite": (197e12, 197e12 / 2),  # v5e
    "TPU v5e": (197e12, 197e12 / 2),
    "TPU v5p": (459e12, 459e12 / 2),
    "TPU v6 lite": (918e12, 918e12 / 2),  # v6e (Trillium)
    "TPU v6e": (918e12, 918e12 / 2),
    "NVIDIA A100": (312e12, 19.5e12),
    "NVIDIA H100": (989e12, 67e12),
    "NVIDIA H200": (989e12, 67e12),
}


def peak_flops(device: jax.Device | None = None, dtype: str = "bfloat16") -> float | None:
    """The chip's peak for `dtype`, or None when the chip is not in the table (CPUs, unknown accelerators)."""
    device = device or jax.devices()[0]
    kind = device.device_kind
    for name, (bf16, fp32) in PEAK_FLOPS.items():
        if kind.startswith(name) or name in kind:
            return bf16 if dtype == "bfloat16" else fp32
    return None


def measured_matmul_flops(size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a float32 (size x size) matmul on the default device, median of `repeats`: the practical peak
    that MFU is measured against on a CPU, where no data-sheet figure applies."""
    import time

    import jax.numpy as jnp
    import numpy as np

    a = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * size**3 / float(np.median(times))
