"""An int8 KV pool's writes for one step of llama-1b's 16 layers (pages of 128, 8 key/value heads of 64), XLA's
scatters (paged_kv.write_kv off a TPU) against the DMA kernel (src/systolic/kernels/paged_attention/kv_write.py),
the two sides alternating round by round on the same slots; the last column says whether both left the pool equal.

    PYTHONPATH=src python benchmarks/kernels/kv_write.py 256:256,1024:256 3   # on a TPU: tokens:decodes rows, rounds
    DRY=1 PYTHONPATH=src python benchmarks/kernels/kv_write.py 256:256 1       # anywhere: a small pool, the interpreter

A row T:D is a step of T tokens: D decodes, each in a page of its own, then 128-token prompts starting mid-page.
"""
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from systolic.kernels.paged_attention import kv_write

# layers, pages (the 1,024 of the chip's rows: the cost is per update, not per pool byte), page size, words a row,
# scales a token (2 x 8 key/value heads)
L, P, ps, W, S = (2, 300, 128, 256, 16) if os.environ.get("DRY") else (16, 1024, 128, 256, 16)


def slots_for(T, decodes, rng):
    """T slots: `decodes` tokens each in a page of its own, then 128-token prompts from the middle of a page."""
    perm = list(rng.permutation(P - 1) + 1)
    out = [perm.pop() * ps + int(rng.integers(0, ps)) for _ in range(decodes)]
    while len(out) < T:  # prompts of 128 tokens starting mid-page
        a, b = perm.pop(), perm.pop()
        for t in range(min(128, T - len(out))):
            out.append(a * ps + 64 + t if t < 64 else b * ps + t - 64)
    return jnp.asarray(out, jnp.int32)


def reference(words, scales, layer, slots, nw, ns, n):
    """XLA's scatters, as write_kv writes an int8 pool off a TPU."""
    page, off = slots // ps, slots % ps
    return words.at[layer, page, off].set(nw), scales.at[layer, page, :, off].set(ns)


def main(T, decodes, rounds=5, reps=10):
    rng = np.random.default_rng(0)
    interpret = jax.devices()[0].platform != "tpu"
    words = jnp.asarray(rng.integers(-100, 100, (L, P, ps, W)), jnp.int32)
    scales = jnp.asarray(rng.random((L, P, S, ps)), jnp.float32)
    slots = slots_for(T, decodes, rng)
    nw = jnp.asarray(rng.integers(-100, 100, (L, T, W)), jnp.int32)
    ns = jnp.asarray(rng.random((L, T, S)), jnp.float32)
    def xla(words, scales, nw, ns):
        for l in range(L):
            words, scales = reference(words, scales, l, slots, nw[l], ns[l], T)
        return words, scales
    def kern(words, scales, nw, ns):
        table = kv_write.runs(slots, T, ps)
        for l in range(L):
            words, scales = kv_write.write(words, scales, l, table, nw[l], ns[l], interpret=interpret)
        return words, scales
    xla, kern = jax.jit(xla, donate_argnums=(0, 1)), jax.jit(kern, donate_argnums=(0, 1))
    a = xla(words.copy(), scales.copy(), nw, ns)
    b = kern(words.copy(), scales.copy(), nw, ns)
    same = bool((a[0] == b[0]).all()) and bool((a[1] == b[1]).all())
    del a, b
    state = {"xla": (words.copy(), scales.copy()), "kernel": (words, scales)}
    times = {"xla": [], "kernel": []}
    for _ in range(rounds):
        for name, fn in (("xla", xla), ("kernel", kern)):
            w, s = state[name]
            w, s = fn(w, s, nw, ns); jax.block_until_ready(w)
            t = time.perf_counter()
            for _ in range(reps):
                w, s = fn(w, s, nw, ns)
            jax.block_until_ready((w, s))
            times[name].append((time.perf_counter() - t) / reps * 1e3)
            state[name] = (w, s)
    print(f"| {T} tokens ({decodes} decodes) | {min(times['xla']):.3f} | {min(times['kernel']):.3f} | {same} |", flush=True)


if __name__ == "__main__":
    print(jax.devices()[0].device_kind)
    print("| step | XLA scatters ms | DMA kernel ms | equal |")
    for spec in sys.argv[1].split(","):
        T, d = map(int, spec.split(":"))
        main(T, d, int(sys.argv[2]) if len(sys.argv) > 2 else 5)
