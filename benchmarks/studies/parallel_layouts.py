"""Throughput of parallel layouts of the lm train step at an equal global batch, on 8 fake CPU devices.

Each layout is a mesh (and any other overrides) for the same model, sequence length and global batch, so the rows
differ only in how the work is split. The layouts run in turns, `--rounds` times (A B C ..., A B C ...), so a
machine that speeds up or slows down during the run affects them alike; a row's figure is its median round.

    python benchmarks/studies/parallel_layouts.py                       # the LAYOUTS below
    python benchmarks/studies/parallel_layouts.py --layout data=8 \
        --layout "data=2,context=4 model.context_attention=allgather"

A layout is `AXIS=N,AXIS=N` (mesh axes; unset ones 1) followed by any KEY=VALUE overrides, space-separated.
Prints a Markdown table: tokens/s, relative to the first layout, step time, compile time, and XLA's per-device
temporaries. On one CPU the 8 "devices" share its cores, so this measures the work each layout adds (collectives,
masked or repeated attention, relayouts), not the speed-up real devices would give.

Uses random tokens (no corpus); the model is a small Llama (`MODEL`).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

MODEL = ["model.d_model=64", "model.layers=2", "model.heads=4", "model.kv_heads=2", "train.steps=1000",
         "optim.warmup_steps=10"]
# (name, overrides): the first row is the baseline of the "relative" column. Add rows here (or pass --layout).
LAYOUTS: list[tuple[str, list[str]]] = [
    ("data=8", ["mesh.data=8"]),
    ("data=4 x context=2", ["mesh.data=4", "mesh.context=2"]),
    ("data=2 x context=4", ["mesh.data=2", "mesh.context=4"]),
    ("context=8", ["mesh.data=1", "mesh.context=8"]),
    ("data=2 x context=4, allgather", ["mesh.data=2", "mesh.context=4", "model.context_attention=allgather"]),
    ("data=2 x fsdp=2 x context=2", ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2"]),
]


@dataclasses.dataclass
class Row:
    name: str
    step: object
    state: object
    batch: dict
    compile_s: float
    temp_bytes: float
    step_s: list[float] = dataclasses.field(default_factory=list)


def parse_layout(text: str) -> tuple[str, list[str]]:
    """"data=2,context=4 model.x=y" -> (the text, its mesh and other overrides)."""
    mesh, *extra = text.split()
    return text, [f"mesh.{item}" for item in mesh.split(",")] + extra


def build(name: str, overrides: list[str], common: list[str]) -> Row:
    import jax
    import numpy as np

    from systolic import config as config_lib
    from systolic.data.tokenizer import ByteTokenizer
    from systolic.runtime import mesh as mesh_lib
    from systolic.runtime.sharding import activate
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.train import abstract_batch, build_step

    # Unset mesh axes 1 (the config's data axis defaults to -1), the layout's own settings last.
    axes = [f"mesh.{a}=1" for a in mesh_lib.AXES]
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [*MODEL, *common, *axes, *overrides]))
    mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:8])
    step = build_step(cfg, mesh, ByteTokenizer())  # random byte ids
    shape = (cfg.train.batch_size, cfg.data.seq_len)
    tokens = np.random.default_rng(0).integers(0, 256, (shape[0], shape[1] + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    batch = {k: jax.device_put(v, step.batch_sharding) for k, v in batch.items()}
    with activate(mesh, step.rules):
        start = time.perf_counter()
        compiled = step.train_step.lower(step.abstract, abstract_batch(cfg, step.batch_sharding)).compile()
        compile_s = time.perf_counter() - start
        state = step.init()
        state, _ = step.train_step(state, batch)  # the jitted step's own first call, off the clock
        jax.block_until_ready(state)
    temp = compiled.memory_analysis().temp_size_in_bytes
    return Row(name, (step, mesh), state, batch, compile_s, temp)


def run(row: Row, steps: int) -> None:
    import jax

    from systolic.runtime.sharding import activate

    step, mesh = row.step
    with activate(mesh, step.rules):
        start = time.perf_counter()
        for _ in range(steps):
            row.state, metrics = step.train_step(row.state, row.batch)
        jax.block_until_ready(metrics)
    row.step_s.append((time.perf_counter() - start) / steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", action="append", help="AXIS=N,... [KEY=VALUE ...]; repeat for several")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows of --seq-len tokens)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    layouts = [parse_layout(t) for t in args.layout] if args.layout else LAYOUTS
    common = [f"data.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}", f"train.batch_size={args.batch}"]
    rows = [build(name, overrides, common) for name, overrides in layouts]
    for _ in range(args.rounds):
        for row in rows:
            run(row, args.steps)
    tokens = args.batch * args.seq_len
    base = tokens / statistics.median(rows[0].step_s)
    print(f"lm {' '.join(MODEL[:4])}, global batch {args.batch} x {args.seq_len} tokens, {args.rounds} rounds of "
          f"{args.steps} steps, layouts in turn; median round\n")
    print("| layout | tokens/s | relative | step (ms) | compile (s) | temporaries / device (MiB) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        step_s = statistics.median(row.step_s)
        print(f"| {row.name} | {tokens / step_s:,.0f} | {tokens / step_s / base:.2f} | {1e3 * step_s:.0f} | "
              f"{row.compile_s:.1f} | {row.temp_bytes / 2**20:.0f} |")


if __name__ == "__main__":
    main()
