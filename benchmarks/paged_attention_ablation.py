"""Where the Pallas paged attention kernel's time goes: the kernel over llama-1b's decode step (every layer, as
benchmarks/paged_attention.py times it) with its score or value matmul, or both, replaced by a cheap stand-in (a
sum over the same rows), over a bfloat16 pool in pages of 16 (the engine's) and of 128, and an int8 pool in pages of
128 (`--kv-cache int8` on a TPU). The variants alternate round by round. If the time does not move without the
matmuls, the kernel is not bound by them.

    PYTHONPATH=src python benchmarks/paged_attention_ablation.py                  # on a TPU: llama-1b:256:256
    PYTHONPATH=src python benchmarks/paged_attention_ablation.py tiny:3:300       # off one: the interpreter, slow

Outputs of the variants are not attention (their point is the time); benchmarks/paged_attention.py checks the
kernel's.
"""

from __future__ import annotations

import sys

import bench_rows  # sys.path[0]: benchmarks/
import paged_attention as bench


def variant(kernel_lib, no_scores: bool, no_values: bool):
    """kernel_lib._online_step with the score matmul, the value matmul or both replaced by row sums."""
    import jax.numpy as jnp
    from jax import lax

    def step(q, kt, vt, visible, state, *, softcap, precision, pick, scale=None):
        m_prev, l_prev, acc_prev = state
        if no_scores:
            s = jnp.broadcast_to(jnp.sum(q.astype(jnp.float32), axis=1, keepdims=True), (q.shape[0], kt.shape[0]))
        else:
            s = lax.dot_general(q, kt, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
        if scale is not None:
            s = s * scale[0]
        s = jnp.where(visible, s, -jnp.inf)
        m_cur = jnp.max(s, axis=1, keepdims=True)
        seen = m_cur > -jnp.inf
        p = jnp.exp(s - jnp.where(seen, m_cur, 0.0))
        weights = p if scale is None else p * scale[1]
        if no_values:
            pv = jnp.broadcast_to(jnp.sum(weights, axis=1, keepdims=True), (q.shape[0], vt.shape[1]))
        else:
            pv = jnp.dot(weights.astype(vt.dtype), vt, precision=precision, preferred_element_type=jnp.float32)
        if pick is not None:
            pv = pick(pv)
        m_next = jnp.maximum(m_prev, m_cur)
        safe = jnp.where(m_next > -jnp.inf, m_next, 0.0)
        alpha = jnp.exp(m_prev - safe)
        beta = jnp.where(seen, jnp.exp(m_cur - safe), 0.0)
        Lq = acc_prev.shape[1]
        return (m_next, alpha * l_prev + beta * jnp.sum(p, axis=1, keepdims=True),
                kernel_lib._lanes(alpha, Lq) * acc_prev + kernel_lib._lanes(beta, Lq) * pv)

    return step


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    row = argv[0] if argv else "llama-1b:256:256"
    import jax

    from systolic.kernels import paged_attention as kernel_lib

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    shape, seqs, positions = row.split(":")
    pools, kernels = {}, {}
    pools["bf16 pages of 16"], _, kernels[16], _ = bench.make_step(shape, int(seqs), int(positions), 1, page=16)
    pools["bf16 pages of 128"], _, kernels[128], _ = bench.make_step(shape, int(seqs), int(positions), 1, page=128)
    q, k, v, pool = pools["bf16 pages of 128"]
    pools["int8 pages of 128"] = (q, k, v, bench.quantized(pool, bench.SHAPES[shape][3]))
    original, fns = kernel_lib._online_step, {}
    variants = {"full": None, "no score dot": (True, False), "no value dot": (False, True), "no dots": (True, True)}
    try:
        for name, which in variants.items():
            kernel_lib._online_step = original if which is None else variant(kernel_lib, *which)
            for pool_name, operands in pools.items():
                f = jax.jit(kernels[16 if "of 16" in pool_name else 128].__wrapped__)  # traced under this variant
                jax.block_until_ready(f(*operands))
                fns[(pool_name, name)] = (lambda f=f, ops=operands: f(*ops))
    finally:
        kernel_lib._online_step = original
    medians = bench_rows.alternating_medians(fns, (), 3, 10)
    lines = [f"| {row} | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    for pool_name in pools:
        lines.append(f"| {pool_name} | " + " | ".join(f"{medians[(pool_name, v)] * 1e3:.3f}" for v in variants) + " |")
    print("ms a step (every layer):\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
