"""Serving's attention over the paged KV pool, alone: the Pallas kernel (src/systolic/kernels/paged_attention/
kernel.py) against the plain-JAX path (reference.py beside it), both through paged_kv.ragged_paged_attention, on the
same step, side by side, the two sides alternating round by round. One "step" is every layer's attention of a decode
batch (a scan over the pool's layers, as the engine runs it), random bfloat16 keys and values, each sequence's pages
shuffled over the pool.

    PYTHONPATH=src python benchmarks/kernels/paged_attention.py                   # on a TPU: the rows below
    PYTHONPATH=src python benchmarks/kernels/paged_attention.py --rows llama-1b:64:256 --rounds 3
    PYTHONPATH=src python benchmarks/kernels/paged_attention.py --kv-cache int8   # int8 pool, beside the bf16 kernel
    PYTHONPATH=src python benchmarks/kernels/paged_attention.py --rows tiny:2:32 --rounds 1 --reps 1   # anywhere

A row is shape:sequences:positions, or shape:sequences:positions:chunk for a continued prompt of `chunk` tokens
per sequence (each token reads its pages). Prints ms per step for each side, the kernel's KV read rate (bytes of
the positions it attends over / its time) and the largest difference between the sides' outputs. Off a TPU the
kernel runs in Pallas's interpreter (for a dry run only: tiny sizes, slow). With `--kv-cache int8` the pool is the
same keys and values quantized as `--kv-cache int8` stores them (each layer on its own: the whole pool in float32 at
once did not fit the v5e for 256 x 256) in pages of 128 (the engine's for int8 on a TPU), both sides read it, and
a third side, the kernel over a bfloat16 pool of the same shape in the engine's pages of 16, alternates with them:
whether the int8 pages pay in the kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
import bench_rows  # noqa: E402  (benchmarks/harness/bench_rows.py)

# (layers, query heads, key/value heads, head_dim, sliding window): the serving rows of benchmarks/harness/tpu_bench.py.
SHAPES = {
    "llama-1b": (16, 32, 8, 64, 0),
    "gemma3-1b": (26, 4, 1, 256, 512),
    "gemma-2b": (18, 8, 1, 256, 0),
    "tiny": (2, 4, 2, 64, 0),
}
ROWS = ("llama-1b:64:256", "llama-1b:256:256", "llama-1b:64:1024", "gemma3-1b:64:256", "gemma-2b:256:256",
        "llama-1b:4:384:128")
PAGE = 16
INT8_PAGE = 128  # kernels/paged_attention/kernel.py's INT8_PAGE (imported after the arguments: jax loads slowly)


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help="shape:sequences:positions[:chunk], comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per row (default 5)")
    p.add_argument("--reps", type=int, default=10, help="steps timed per round and side (default 10)")
    p.add_argument("--page-size", type=int, default=None,
                   help=f"tokens a page (default as the engine's on a TPU: {PAGE}, an int8 pool's {INT8_PAGE})")
    p.add_argument("--kv-cache", choices=("auto", "int8"), default="auto",
                   help="the pool: bfloat16 (auto), or int8 values and scales beside the bfloat16 kernel")
    return p.parse_args(argv)


def make_step(shape: str, seqs: int, positions: int, chunk: int, seed: int = 0, page: int = PAGE):
    """The pool (L, pages, page, KV * 2hd) with `positions` cached per sequence (the last `chunk` of them this
    step's), the step's batch and queries, and the two sides as jitted functions of (q, pool)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from systolic.kernels.paged_attention import paged_kv as pa

    L, H, KV, hd, window = SHAPES[shape]
    per_seq = -(-positions // page)
    pages = seqs * per_seq + 1  # page 0: the null page
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.arange(1, pages)).reshape(seqs, per_seq).astype(np.int32)
    T = seqs * chunk
    pos = np.tile(np.arange(positions - chunk, positions), seqs).astype(np.int32)  # (T,)
    rows = np.repeat(np.arange(seqs), chunk).astype(np.int32)
    batch = pa.RaggedBatch(
        positions=jnp.asarray(pos), rows=jnp.asarray(rows),
        slots=jnp.asarray(order[rows, pos // page] * page + pos % page), num_tokens=jnp.asarray(T, jnp.int32),
        page_table=jnp.asarray(order), kv_lens=jnp.full((seqs,), positions, jnp.int32),
        cu_q_lens=jnp.asarray(np.arange(seqs + 1) * chunk, jnp.int32), num_seqs=jnp.asarray([seqs], jnp.int32),
        last=jnp.asarray(np.arange(seqs) * chunk + chunk - 1, jnp.int32),
        seq_lens=jnp.full((seqs,), positions, jnp.int32))
    key = jax.random.key(seed)
    pool = jax.random.normal(key, (L, pages, page, KV * 2 * hd), jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 1), (L, T, H, hd), jnp.bfloat16)
    # This step's keys and values: what the pool holds at their slots (write_kv put them there).
    step_rows = pool[:, order[rows, pos // page], pos % page].reshape(L, T, KV, 2, hd)
    k, v = step_rows[..., 0, :], step_rows[..., 1, :]

    def side(kernel: bool):
        def run(q, k, v, pool):
            def layer(_, xs):
                l, q, k, v = xs
                return None, pa.ragged_paged_attention(q, k, v, pool, l, batch, window=window, kernel=kernel)

            return jax.lax.scan(layer, None, (jnp.arange(L), q, k, v))[1]  # (L, T, H, hd)

        return jax.jit(run)

    read = L * seqs * chunk * min(positions, window or positions) * KV * 2 * hd * 2  # bytes the tokens attend over
    return (q, k, v, pool), side(False), side(True), read


def quantized(pool, head_dim: int):
    """The bfloat16 pool as an int8 one (`--kv-cache int8`'s words and scales), a layer at a time."""
    import jax

    from systolic.kernels.paged_attention import int8_pool

    return jax.jit(int8_pool.quantize_pool, static_argnums=1)(pool, head_dim)


def main(argv=None) -> int:
    args = _args(argv)
    import jax
    import numpy as np

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    int8 = args.kv_cache == "int8"
    header = "| row | plain ms | kernel ms | speed-up | kernel GB/s | max abs diff |" + (
        " kernel over bfloat16 ms | int8 / bfloat16 |" if int8 else "")
    lines = [header, "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if int8 else "")]
    for row in args.rows.split(","):
        shape, seqs, positions, *chunk = row.split(":")
        chunk = int(chunk[0]) if chunk else 1
        page = args.page_size if args.page_size is not None else (INT8_PAGE if int8 else PAGE)
        operands, plain, kernel, read = make_step(shape, int(seqs), int(positions), chunk, page=page)
        calls = {"plain": (plain, operands), "kernel": (kernel, operands)}
        if int8:  # both sides over the int8 pool; the kernel over a bfloat16 one in the engine's pages beside them
            q, k, v, pool = operands
            int8_operands = (q, k, v, quantized(pool, SHAPES[shape][3]))
            del pool, operands
            bf16_operands, _, bf16_kernel, _ = make_step(shape, int(seqs), int(positions), chunk, page=PAGE)
            calls = {"plain": (plain, int8_operands), "kernel": (kernel, int8_operands),
                     "bf16": (bf16_kernel, bf16_operands)}
        fns = {name: (lambda f=f, ops=ops: f(*ops)) for name, (f, ops) in calls.items()}
        outs = {name: jax.block_until_ready(fn()) for name, fn in fns.items()}  # each compiled before the timing
        diff = float(np.max(np.abs(np.asarray(outs["plain"], np.float32) - np.asarray(outs["kernel"], np.float32))))
        medians = bench_rows.alternating_medians(fns, (), args.rounds, args.reps)
        p, k = medians["plain"], medians["kernel"]
        lines.append(f"| {row} | {p * 1e3:.3f} | {k * 1e3:.3f} | {p / k:.2f}x | {read / k / 1e9:.0f} | {diff:.4f} |"
                     + (f" {medians['bf16'] * 1e3:.3f} | {k / medians['bf16']:.2f}x |" if int8 else ""))
        print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
