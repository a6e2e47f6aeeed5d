"""CPU-only formulations of the transformer's hot spots, each measured against PyTorch on the same CPU.

On GPU/TPU every function here is the plain formulation (`cpu_tweak` is False there). On XLA:CPU three
rewrites train faster (attempts and figures: docs/benchmarks.md, `benchmarks/lm_vs_pytorch.py`):

- `project`: matmuls on activations flattened to (B*T, D). With x (B, T, D) @ W the weight gradient contracts
  over two axes, which XLA:CPU lowers with a physical transpose fused into slow elementwise loops.
- `causal_attention`: pre-scaled queries plus an additive causal bias, instead of `where(mask, s, -inf)`.
- `gradient_barrier`: an identity on the residual stream whose backward XLA cannot see through, so its fusion
  pass stops copying the residual gradient's elementwise chain into every consumer (work growing with depth^2).

`SYSTOLIC_CPU_TWEAKS` (comma-separated names, `all` or `none`; default `all`) switches them for ablations.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

TWEAKS = ("flatten", "attention", "barrier")


def cpu_tweak(name: str) -> bool:
    """Whether the CPU rewrite `name` is on: only on the CPU backend, and as `SYSTOLIC_CPU_TWEAKS` says."""
    if jax.default_backend() != "cpu":
        return False
    setting = os.environ.get("SYSTOLIC_CPU_TWEAKS", "all").strip()
    if setting == "all":
        return True
    return name in {s.strip() for s in setting.split(",")}


def project(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """Contracts the last `contract` axes of x with the first `contract` axes of w: (*lead, *k) @ (*k, *out)."""
    if not cpu_tweak("flatten"):
        return jnp.tensordot(x, w, axes=contract)
    lead, k, out = x.shape[: x.ndim - contract], math.prod(w.shape[:contract]), w.shape[contract:]
    y = x.reshape(-1, k) @ w.reshape(k, -1)  # (prod(lead), prod(out))
    return y.reshape(*lead, *out)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal grouped-query attention: q (B, T, H, hd), k and v (B, T, KV, hd) -> (B, T, H, hd)."""
    B, T, H, hd = q.shape
    KV = k.shape[2]
    q = (q * (1.0 / math.sqrt(hd))).reshape(B, T, KV, H // KV, hd)  # (B, T, KV, G, hd)
    scores = jnp.einsum("bqkgh,bskh->bkgqs", q, k)  # (B, KV, G, T, T)
    # -1e30 rather than -inf: exp underflows to exactly 0 and no inf - inf appears in the backward pass.
    bias = jnp.where(jnp.tril(jnp.ones((T, T), bool)), 0.0, -1e30).astype(scores.dtype)  # (T, T)
    probs = jax.nn.softmax((scores + bias).astype(jnp.float32), axis=-1).astype(v.dtype)  # (B, KV, G, T, T)
    out = jnp.einsum("bkgqs,bskh->bqkgh", probs, v)  # (B, T, KV, G, hd)
    return out.reshape(B, T, H, hd)


@jax.custom_vjp
def gradient_barrier(x: jax.Array) -> jax.Array:
    """The identity, forward and backward; XLA cannot fuse across its backward (see the module docstring)."""
    return x


def _barrier_fwd(x: jax.Array):
    return x, None


def _barrier_bwd(_, g: jax.Array):
    # A loop whose trip count is only known at run time: `optimization_barrier` would not do (XLA:CPU removes
    # it before fusion), nor would a loop whose body simplifies to the identity. The count is 0 unless g[0] is
    # NaN, and then the body runs once with i = 0, multiplying by 1: the identity, but not one XLA can prove.
    trips = jnp.isnan(g.reshape(-1)[0]).astype(jnp.int32)
    return (jax.lax.fori_loop(0, trips, lambda i, c: c * (i + 1).astype(c.dtype), g),)


gradient_barrier.defvjp(_barrier_fwd, _barrier_bwd)
