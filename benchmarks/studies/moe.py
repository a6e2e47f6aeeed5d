"""Tokens/s of one mixture-of-experts MLP layer, forward + backward, by dispatch, against a dense MLP of the same
active FLOPs, at the moe-tiny recipe's sizes (d_model 192, 8 experts of width 256, 2 per token, 16 x 128 tokens).

Variants: dropless (tokens sorted by expert) with `jax.lax.ragged_dot` and, where the CPU rewrites are on (the
default on CPU), with lm/model/cpu.py's tiled grouped matmul; capacity dispatch (one-hot einsums into capacity_factor x
an even share of slots per expert and sequence) at factors 1.25 and 2; and the dense SwiGLU MLP of width 512
(= 2 experts x 256: the same matmul FLOPs per token as the MoE's active experts). The process starts as the CLI
does (`cpu_tuning.apply_at_start`). The variants alternate within each round (so drifts in the machine's speed
hit them alike); the table gives each one's median over the rounds, and XLA's own FLOP count of the compiled
step over the model FLOPs of the active matmuls.

    python benchmarks/studies/moe.py [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

from systolic.runtime import cpu_settings, cpu_tuning

cpu_tuning.apply_at_start(workload="lm", stepping=True)  # before jax starts: the CLI's XLA:CPU flags and allocator setting

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from systolic import config as config_lib  # noqa: E402
from systolic.workloads.lm.config import LMConfig  # noqa: E402
from systolic.workloads.lm.model.sublayers import MLP, MoE  # noqa: E402

SIZES = ["model.d_model=192", "model.layers=4", "model.heads=6", "model.dtype=float32", "model.moe.experts=8",
         "model.moe.top_k=2", "model.moe.mlp_dim=256"]
BATCH, SEQ = 16, 128


@contextlib.contextmanager
def grouped_rewrite(on: bool):
    """Traces with lm/model/cpu.py's tiled grouped matmul on or off (SYSTOLIC_CPU_TWEAKS, read at trace time)."""
    before = os.environ.get(cpu_settings.TWEAKS_ENV)
    if not on:
        os.environ[cpu_settings.TWEAKS_ENV] = "flatten,attention,barrier,malloc"
    cpu_settings.settings.cache_clear()
    try:
        yield
    finally:
        os.environ.pop(cpu_settings.TWEAKS_ENV, None)
        if before is not None:
            os.environ[cpu_settings.TWEAKS_ENV] = before
        cpu_settings.settings.cache_clear()


def variants() -> dict[str, tuple[nnx.Module, bool]]:
    """name -> (layer, the tiled grouped matmul on)."""
    def cfg(*extra: str):
        return config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [*SIZES, *extra])).model

    out = {"dropless, jax.lax.ragged_dot": (MoE(cfg(), rngs=nnx.Rngs(0)), False)}
    if jax.default_backend() == "cpu":
        out["dropless, tiled grouped matmul (CPU default)"] = (MoE(cfg(), rngs=nnx.Rngs(0)), True)
    return out | {
        "capacity 1.25, one-hot einsums": (MoE(cfg("model.moe.capacity_factor=1.25"), rngs=nnx.Rngs(0)), True),
        "capacity 2.0, one-hot einsums": (MoE(cfg("model.moe.capacity_factor=2"), rngs=nnx.Rngs(0)), True),
        DENSE: (MLP(cfg("model.mlp_dim=512"), rngs=nnx.Rngs(0)), True),
    }


DENSE = "dense MLP, width 512 (same active FLOPs)"


def make_step(layer: nnx.Module):
    """A jitted forward + backward of the layer on (BATCH, SEQ, D) activations: (gradients of params and x)."""
    graphdef, params = nnx.split(layer, nnx.Param)

    def loss(params, x):
        y = nnx.merge(graphdef, params)(x)
        y = y[0] if isinstance(y, tuple) else y  # MoE: (y, stats)
        return jnp.mean(jnp.square(y))

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return step, params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed calls per variant per round")
    args = parser.parse_args()
    x = jax.random.normal(jax.random.PRNGKey(0), (BATCH, SEQ, 192), jnp.float32)
    steps, xla_flops = {}, {}
    for name, (layer, grouped) in variants().items():
        step, params = make_step(layer)
        with grouped_rewrite(grouped):
            compiled = step.lower(params, x).compile()
        step = compiled
        cost = compiled.cost_analysis()
        xla_flops[name] = float((cost[0] if isinstance(cost, list) else cost)["flops"])
        jax.block_until_ready(step(params, x))  # compile and warm up
        steps[name] = (step, params)
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, (step, params) in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                out = step(params, x)
            jax.block_until_ready(out)
            seconds[name].append((time.perf_counter() - start) / args.steps)
    tokens = BATCH * SEQ
    model_flops = 6 * tokens * 3 * 192 * 512  # forward + backward of the active matmuls (the router's aside)
    dense = statistics.median(seconds[DENSE])
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({len(jax.devices())} device(s)); {tokens} tokens a "
          f"step, {args.rounds} rounds x {args.steps} steps, variants alternating\n")
    print("| layer (forward + backward) | ms per step (median) | tokens/s | vs dense MLP | XLA FLOPs / model FLOPs |")
    print("|---|---|---|---|---|")
    for name, times in seconds.items():
        s = statistics.median(times)
        print(f"| {name} | {s * 1e3:.1f} | {tokens / s:,.0f} | {dense / s:.2f}x | {xla_flops[name] / model_flops:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
