"""How to put PPO's rollout in a random order on the chip: the shuffle's variants, timed side by side.

    bash benchmarks/tpu.sh env python3 benchmarks/gather_variants.py    # on the chip; `python` it anywhere else
    python benchmarks/gather_variants.py --rows 512 262144 --repeats 20

The data: 8 seeds, each n examples of PPO's CartPole batch (observation 4 floats, action int32, log-probability,
value, advantage, return: 9 columns of 32 bits); n = 512 (the rl-cartpole recipe, 4 environments x 128 steps)
and 262,144 (2,048 environments x 128). Each variant applies one fresh random order per seed:
- `per leaf`: a vmapped gather of each of the six leaves (systolic before 2026-12-07, and PureJaxRL's ppo.py);
- `packed`: `take_examples` (systolic's shuffle between session 18's change and the sort), the leaves' bits side
  by side, one gather of 9-column rows (still its path for examples wider than 32 words);
- `packed, flat`: the same rows with the seeds folded into the row index (one gather without batch dimensions);
- `sort`: no gather, `lax.sort` of random keys carrying the nine columns along (a random order by construction;
  systolic's `shuffle_examples` since the chip measured it 4x faster than `packed` at 262,144, 2026-12-07).
The orders themselves (`jax.random.permutation`, a sort) are drawn outside the timed gathers, once, and timed apart
as `permutation`. On the chip (2026-12-07) the per-leaf gathers took 63% of a 2,048-environment PPO update.
"""

from __future__ import annotations

import argparse
import sys

from bench_rows import median_seconds  # sys.path[0]: benchmarks/


def variants(seeds: int, n: int):
    import jax
    import jax.numpy as jnp

    from systolic.workloads.rl.optimization import take_examples

    key = jax.random.PRNGKey(0)
    keys = jax.random.split(key, 7)
    data = {"obs": jax.random.normal(keys[0], (seeds, n, 4)),
            "action": jax.random.randint(keys[1], (seeds, n), 0, 2),
            **{name: jax.random.normal(k, (seeds, n)) for name, k in
               zip(("log_prob", "value", "advantages", "returns"), keys[2:6], strict=True)}}
    axes = jax.tree.map(lambda _: 0, data)
    permute = jax.jit(jax.vmap(lambda k: jax.random.permutation(k, n)))
    seed_keys = jax.random.split(keys[6], seeds)
    orders = permute(seed_keys)  # (S, n)

    def per_leaf(data, orders):
        return jax.vmap(lambda d, o: jax.tree.map(lambda x: x[o], d))(data, orders)

    def packed(data, orders):
        return jax.vmap(lambda d, o: take_examples(d, axes, o))(data, orders)

    def packed_flat(data, orders):
        columns = jnp.concatenate([jax.lax.bitcast_convert_type(x.reshape(seeds, n, -1), jnp.uint32)
                                   for x in jax.tree.leaves(data)], axis=-1)  # (S, n, 9)
        flat = (orders + n * jnp.arange(seeds)[:, None]).reshape(-1)  # (S*n,)
        return columns.reshape(seeds * n, -1)[flat].reshape(seeds, n, -1)

    def sort(data, orders):
        del orders  # its own random keys are the order
        columns = [c for x in jax.tree.leaves(data)
                   for c in jnp.moveaxis(jax.lax.bitcast_convert_type(x.reshape(seeds, n, -1), jnp.uint32), -1, 0)]
        bits = jax.vmap(lambda k: jax.random.bits(k, (n,), jnp.uint32))(seed_keys)
        return jax.lax.sort((bits, *columns), dimension=1, num_keys=1)[1:]

    return {"permutation": (permute, (seed_keys,)), "per leaf": (jax.jit(per_leaf), (data, orders)),
            "packed": (jax.jit(packed), (data, orders)), "packed, flat": (jax.jit(packed_flat), (data, orders)),
            "sort": (jax.jit(sort), (data, orders))}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 262144], help="examples per seed")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    import jax

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.seeds} seeds, median of {args.repeats}")
    print("| examples a seed | variant | ms | ns a row |")
    print("|---|---|---|---|")
    for n in args.rows:
        for name, (fn, fn_args) in variants(args.seeds, n).items():
            seconds = median_seconds(fn, fn_args, args.repeats)
            print(f"| {n:,} | {name} | {seconds * 1e3:.3f} | {seconds * 1e9 / (args.seeds * n):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
