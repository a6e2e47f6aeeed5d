"""How a decode step's MLP reads int8 weights stacked by layer, on the chip: one layer's MLP (up, gate, down
projections of llama-1b: 2,048 x 8,192) for each of 16 layers in a scan, T tokens, bfloat16 against int8 weights
(w8a8: int8 x int8 dots; weight-only: bf16 x s8), and the ways of storing the int8 weights.

    PYTHONPATH=src python benchmarks/int8_weights.py [--tokens 256] [--rounds 5]   # on the chip
    PYTHONPATH=src python benchmarks/int8_weights.py --aot                      # here: the copies column only

Why: on the v5e (2026-12-07) the serving step's w8a8 projections took as long as their int8 weights' read plus
their int8 matmul, one after the other: in the engine's compiled step the TPU compiler copied each layer's slice of a
stacked int8 weight into on-chip memory (a `dynamic-slice` fusion of its own, 23 us for a 16 MiB MLP weight) before
the dot, where it fuses the slice of a bfloat16 weight into the dot itself. Each row prints its ms a layer, the
weights' bytes a layer over that time, and how many separate copies of a weight slice the compiled program makes
(`weight copies`). Variants (`VARIANTS`): the model's own path (lm/model/quant.py `project` over qwix arrays sliced
by a scan), the same with each layer's weights as separate arrays (an unrolled loop: no slice), the int8 values fed
to the dot through an optimization barrier (forces the copies), and weight-only int8 (bf16 x s8 dots).

Measured on the v5e at 256 tokens (2026-12-07, docs/benchmarks.md): this loop alone compiles without the copies,
and w8a8 runs a layer in 0.100 ms against bfloat16's 0.166 (1.66x). Its weights are quantized from bfloat16, so
their scales are bfloat16; the engine's were float32 (quantized from a float32 checkpoint), and float32 scales are
what made the compiler copy the slices (the engine's step compiled for compile-only v5e devices: 7 copies a layer
with float32 scales, none with bfloat16 ones). `--aot` compiles for those devices here (libtpu, no chip).
"""

from __future__ import annotations

import argparse
import re
import sys

LAYERS, D, F = 16, 2048, 8192


def build(variant: str, tokens: int):
    """(jitted fn, its args, weight bytes per layer) for one variant."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import qwix

    from systolic.workloads.lm.model import quant

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, tokens, D), np.float32) * 0.5, jnp.bfloat16)
    floats = {name: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, jnp.bfloat16)
              for name, shape in (("up", (LAYERS, D, F)), ("gate", (LAYERS, D, F)), ("down", (LAYERS, F, D)))}
    if variant == "bf16":
        weights, mode = floats, "none"
    else:
        weights = {k: qwix.quantize(w, jnp.int8, channelwise_axes=[0, 2]) for k, w in floats.items()}
        mode = "int8" if variant.startswith("w8a8") else "none"
    per_layer = sum(a.nbytes for a in jax.tree.leaves(weights)) // LAYERS

    def mlp(h, w):
        if variant.endswith("barrier"):
            w = jax.lax.optimization_barrier(w)
        up = quant.project(h, w["up"], 1, mode)
        gate = quant.project(h, w["gate"], 1, mode)
        return h + quant.project(jax.nn.silu(gate) * up, w["down"], 1, mode)

    if variant.endswith("unrolled"):
        layers = [jax.tree.map(lambda a, i=i: a[i], weights) for i in range(LAYERS)]  # a QArray: values and scales

        @jax.jit
        def run(h, layers):
            for w in layers:
                h = mlp(h, w)
            return h

        return run, (x, layers), per_layer

    @jax.jit
    def run(h, weights):
        return jax.lax.scan(lambda h, w: (mlp(h, w), None), h, weights)[0]

    return run, (x, weights), per_layer


def aot_device():
    from systolic.plan import targets
    from systolic.plan.planner import devices_for

    return devices_for(targets.resolve("v5e-1", mesh_devices=1))[0]


VARIANTS = ("bf16", "w8a8", "w8a8 unrolled", "w8a8 barrier", "int8", "int8 unrolled")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="256")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--aot", action="store_true", help="only compile, for a v5e's compile-only devices (libtpu "
                   "installed, no chip): the weight copies column")
    args = p.parse_args(argv)
    import jax

    sys.path.insert(0, "benchmarks")
    from bench_rows import alternating_medians

    print(f"{jax.devices()[0].device_kind}: {LAYERS} layers of an MLP {D} x {F}, ms a layer (median of "
          f"{args.rounds} alternating rounds of 10 calls)")
    print(f"{'tokens':>6}  {'variant':<16} {'ms/layer':>9} {'GB/s':>7} {'weight copies':>13}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        built = {v: build(v, tokens) for v in args.variants.split(",")}
        copies = {}
        for v, (fn, fargs, _) in built.items():
            if args.aot:  # compile-only devices of a v5e: the TPU compiler's program, nothing run
                where = jax.sharding.SingleDeviceSharding(aot_device())
                fargs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where), fargs)
            hlo = fn.lower(*fargs).compile().as_text()
            copies[v] = len(re.findall(r"%[a-z_-]*dynamic-slice[a-z_.0-9-]* = s8\[(?:2048,8192|8192,2048)\]", hlo))
        if args.aot:
            for v in built:
                print(f"{tokens:>6}  {v:<16} {'':>9} {'':>7} {copies[v]:>13}")
            continue
        times = alternating_medians({v: (lambda fn=fn, fargs=fargs: fn(*fargs)) for v, (fn, fargs, _) in
                                     built.items()}, (), args.rounds, 10)
        for v, (_, _, per_layer) in built.items():
            ms = times[v] / LAYERS * 1e3
            print(f"{tokens:>6}  {v:<16} {ms:9.4f} {per_layer / (ms / 1e3) / 1e9:7.0f} {copies[v]:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
