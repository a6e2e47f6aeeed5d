"""What the CLI calls for the `lm` workload: train (then report and sample) and generate from a run directory."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import jax

from systolic.data.tokenizer import store_in_run, tokenizer_for_training
from systolic.engine import loop
from systolic.engine.checkpoint import has_checkpoints
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate
from systolic.workloads import Workload
from systolic.workloads.lm import init_from, sample
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.train import baseline_nats_per_byte, build_task



def train(cfg: LMConfig, run_dir: Path, quiet: bool = False) -> loop.RunResult:
    init_from.check_not_imported(run_dir)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    # A run that resumes reads its own copy of the tokenizer; a fresh one stores a copy once its input checked out.
    spec = tokenizer_for_training(run_dir, cfg.data.tokenizer, resuming=cfg.checkpoint.resume and has_checkpoints(run_dir))
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=spec))
    prepared = build_task(cfg, mesh)
    if jax.process_index() == 0:
        store_in_run(run_dir, spec)
    data = prepared.corpus
    say = (lambda *a: None) if quiet or jax.process_index() != 0 else print
    say(f"lm: {prepared.param_count / 1e6:.2f}M parameters ({cfg.model.family}, {cfg.model.layers} layers, "
        f"d_model {cfg.model.d_model}) on mesh {mesh_lib.describe(mesh)} ({jax.device_count()} {jax.default_backend()} devices)")
    say(f"data: {data.num_docs[0]:,} train / {data.num_docs[1]:,} validation documents, "
        f"{len(data.train_tokens):,} / {len(data.val_tokens):,} tokens; run directory {run_dir}")
    settings = loop.LoopSettings(steps=cfg.train.steps, eval_every=cfg.train.eval_every, loop=cfg.loop,
                                 checkpoint=cfg.checkpoint, observe=cfg.observe, quiet=quiet)
    with activate(mesh, prepared.rules):
        result = loop.train(prepared.task, settings, run_dir)
    if result.preempted or result.final_step < cfg.train.steps:
        say(f"stopped at step {result.final_step} of {cfg.train.steps} with a checkpoint; run the same command "
            "again to continue.")
        return result
    baseline = baseline_nats_per_byte(data, prepared.vocab)
    ev = result.eval_metrics
    if ev:
        say(f"validation: {ev['nats_per_byte']:.4f} nats/byte = {ev['bits_per_byte']:.4f} bits/byte "
            f"(unigram baseline {baseline:.4f} nats/byte = {baseline / math.log(2):.4f} bits/byte)")
    if result.items_per_s:
        say(f"throughput: {result.items_per_s:,.0f} tokens/s; first step (compile) {result.compile_s:.1f} s; "
            f"wall time {result.wall_s:.1f} s")
    if cfg.sample.max_new_tokens and jax.process_index() == 0 and not quiet:
        text = sample.sample_text(cfg, prepared.graphdef, result.state.params, prepared.vocab,
                                  prompt=cfg.sample.prompt, max_new_tokens=cfg.sample.max_new_tokens,
                                  temperature=cfg.sample.temperature, top_k=cfg.sample.top_k,
                                  top_p=cfg.sample.top_p, seed=cfg.sample.seed)
        say(f"sample (temperature {cfg.sample.temperature}, top-k {cfg.sample.top_k}):\n{cfg.sample.prompt}{text}")
    return result



@contextlib.contextmanager
def build_bench_task(cfg: LMConfig) -> Iterator[loop.Task]:
    """The real train task on the configured mesh, made current for `systolic bench`."""
    mesh = mesh_lib.make_mesh(cfg.mesh)
    prepared = build_task(cfg, mesh)
    with activate(mesh, prepared.rules):
        yield prepared.task


def plan(cfg: LMConfig, target: str):
    """Compiles the real train step ahead of time from abstract inputs on the configured (fake) mesh."""
    from systolic.engine.plan import make_plan
    from systolic.workloads.lm.flops import train_flops_per_token
    from systolic.workloads.lm.model import resolve_dtype
    from systolic.workloads.lm.train import build_step

    mesh = mesh_lib.make_mesh(cfg.mesh)

    def compile_step(cfg: LMConfig):
        step = build_step(cfg, mesh)
        batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len), jax.numpy.int32,
                                     sharding=step.batch_sharding)
        with activate(mesh, step.rules):
            return step, step.train_step.lower(step.abstract, {"inputs": batch, "targets": batch}).compile()

    step, compiled = compile_step(cfg)
    unrolled = None
    if cfg.model.scan_layers:
        _, unrolled = compile_step(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False)))
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(step.abstract.params))
    tokens = cfg.train.batch_size * cfg.data.seq_len
    dtype = "bfloat16" if cfg.model.dtype in ("auto", "bfloat16") else "float32"
    return make_plan(compiled, target=target, devices=mesh.size, params=params,
                     model_flops=tokens * train_flops_per_token(cfg.model, step.vocab, cfg.data.seq_len), dtype=dtype,
                     cost_compiled=unrolled)


def generate(run_dir: Path, prompt: str | None, max_new_tokens: int | None, temperature: float | None,
             top_k: int | None, top_p: float | None, seed: int | None) -> str:
    return sample.generate_from_run(run_dir, prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_k=top_k, top_p=top_p, seed=seed)


WORKLOAD = Workload(name="lm", config=LMConfig, default_recipe="lm-tiny",
                    commands={"train": train, "generate": generate, "bench": build_bench_task, "plan": plan},
                    resolve_config=init_from.resolve_config)  # with init.from: the source's model and tokenizer
