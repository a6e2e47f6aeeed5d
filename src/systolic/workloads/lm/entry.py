"""What the CLI calls for the `lm` workload: train (then report and sample), generate from and evaluate a run directory."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import jax

from systolic.data.sft import ChatCorpus
from systolic.data.tokenizer import make_tokenizer, store_in_run, tokenizer_for_training
from systolic.engine import loop
from systolic.engine.checkpoint import has_checkpoints
from systolic.engine.run import Run
from systolic.engine.state import param_count
from systolic.plan.planner import StepProgram
from systolic.errors import UserError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.platform import compile_platform
from systolic.runtime.sharding import activate
from systolic.workloads.lm import generate as generate_lib, init_from, preflight
from systolic.workloads.lm.parallel import context
from systolic.workloads.lm.config import LMConfig
from systolic.kernels.splash import tuned_block_sizes as splash_blocks
from systolic.workloads.lm.model.config import REMAT_POLICIES, ModelConfig
from systolic.workloads.lm.corpus import baseline_nats_per_byte
from systolic.workloads.lm.post import dpo_task
from systolic.workloads.lm.train import BuiltLMTask, build_task, model_params



def train(cfg: LMConfig, run_dir: Path, quiet: bool = False) -> loop.RunResult:
    if cfg.objective == "grpo":
        from systolic.workloads.lm.post import grpo  # the rollouts' engine and rewards load for GRPO runs alone

        return grpo.train(cfg, run_dir, quiet)
    init_from.check_not_imported(run_dir)
    if cfg.model.lora.rank and not cfg.init.from_:
        raise UserError(
            f"model.lora.rank={cfg.model.lora.rank} trains low-rank adapters on frozen base weights, but init.from is "
            "not set, so the base would be random and stay random. Expected init.from naming the run to adapt (an lm "
            "run, or a `systolic convert from-hf` import). Fix: e.g. `systolic convert from-hf hf/base runs/base`, "
            "then add init.from=runs/base; or set model.lora.rank=0 to train every weight."
        )
    mesh = mesh_lib.make_mesh(cfg.mesh)
    # A run that resumes reads its own copy of the tokenizer; a fresh one stores a copy once its input checked out.
    spec = tokenizer_for_training(run_dir, cfg.data.tokenizer, resuming=cfg.checkpoint.resume and has_checkpoints(run_dir))
    tokenizer = make_tokenizer(spec)
    prepared = _build(cfg, mesh, tokenizer)
    if jax.process_index() == 0:
        store_in_run(run_dir, spec)
    data = prepared.corpus
    run = Run.start(cfg, steps=cfg.train.steps, eval_every=cfg.train.eval_every, quiet=quiet)
    say = run.say
    trained = _trained(prepared.trainable_count, prepared.param_count, cfg)
    say(f"lm: {prepared.param_count / 1e6:.2f}M parameters, {trained} ({cfg.model.family}, {cfg.model.layers} layers, "
        f"d_model {cfg.model.d_model}{_moe_text(cfg, prepared.vocab)}) on mesh {mesh_lib.describe(mesh)} "
        f"({jax.device_count()} {jax.default_backend()} devices)")
    chat, dpo = isinstance(data, ChatCorpus), cfg.objective == "dpo"
    if chat or dpo:
        say(f"data: {data.describe()}; run directory {run_dir}")
    else:
        say(f"data: {data.num_docs[0]:,} train / {data.num_docs[1]:,} validation documents, "
            f"{len(data.train_tokens):,} / {len(data.val_tokens):,} tokens; run directory {run_dir}")
        if data.origin:
            say(data.origin)
    if not (chat or dpo) and data.mixture:
        total = sum(w for _, _, w in data.mixture)
        say("mixture: " + ", ".join(f"{path} {w / total:.0%} of rows ({len(t):,} training tokens)"
                                    for path, t, w in data.mixture))
    with activate(mesh, prepared.rules):
        result = run.loop(prepared.task, run_dir)
    if run.stopped(result):
        return result
    ev = result.eval_metrics
    if ev and chat:
        say(f"validation: {ev['loss']:.4f} nats per assistant token of the held-out examples")
    elif ev and dpo:
        say(f"validation: DPO loss {ev['loss']:.4f}, preference accuracy {ev['rewards/accuracies']:.1%}, reward "
            f"margin {ev['rewards/margins']:.4f} over the held-out pairs")
    elif ev:
        baseline = baseline_nats_per_byte(data, prepared.vocab)
        say(f"validation: {ev['nats_per_byte']:.4f} nats/byte = {ev['bits_per_byte']:.4f} bits/byte "
            f"(unigram baseline {baseline:.4f} nats/byte = {baseline / math.log(2):.4f} bits/byte)")
    run.say_throughput(result, "tokens/s")
    if cfg.sample.max_new_tokens and jax.process_index() == 0 and not quiet:
        # A chat fine-tune answers the prompt as a user message, in its template; other runs continue the prompt.
        params = dpo_task.policy_params(cfg, result.state) if dpo else model_params(result.state)
        generate_lib.say_sample(say, tokenizer, prepared.graphdef, params, cfg.sample, chat=chat or dpo,
                          held_out=None if chat or dpo else data.val_tokens)
    return result



def _build(cfg: LMConfig, mesh, tokenizer) -> BuiltLMTask:
    """The train task of the config's objective."""
    if cfg.objective == "dpo":
        return dpo_task.build_dpo_task(cfg, mesh, tokenizer)
    return build_task(cfg, mesh, tokenizer)


def _moe_text(cfg: LMConfig, vocab: int) -> str:
    """The start-up line's MoE part: experts and the matmul weights one token is multiplied by (what FLOPs count)."""
    from systolic.workloads.lm.model.flops import matmul_params

    m = cfg.model
    if not m.moe.experts:
        return ""
    return (f", {m.moe.top_k} of {m.moe.experts} experts in {len(m.moe_layers)} layers, "
            f"{matmul_params(m, vocab) / 1e6:.2f}M matmul weights active per token")


def _trained(trainable: int, total: int, cfg: LMConfig) -> str:
    """What the start-up line says is trained: every parameter, or the LoRA adapters alone."""
    if trainable == total:
        return "all trained"
    lora = cfg.model.lora
    return (f"{trainable:,} ({100 * trainable / total:.2g}%) trained: LoRA rank {lora.rank} on "
            f"{','.join(lora.target_names(cfg.model.family))}, the rest frozen")


@contextlib.contextmanager
def build_bench_task(cfg: LMConfig) -> Iterator[loop.Task]:
    """The real train task on the configured mesh, made current for `systolic bench`."""
    mesh = mesh_lib.make_mesh(cfg.mesh)
    prepared = _build(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    with activate(mesh, prepared.rules):
        yield prepared.task


def plan(cfg: LMConfig, devices: list) -> StepProgram:
    """The real train step lowered from abstract inputs on a mesh of `devices` (the target's), for `systolic plan`.

    XLA's cost analysis cannot see inside the splash attention kernel (a Pallas kernel, a custom call to XLA): its
    FLOPs are added from the formula's attention term."""
    from systolic.workloads.lm.model import attention
    from systolic.workloads.lm.model.flops import attention_width, train_flops_per_token
    from systolic.workloads.lm.model.layers import resolve_dtype
    from systolic.workloads.lm.train import abstract_batch, build_step

    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    tokenizer = make_tokenizer(cfg.data.tokenizer)
    if cfg.objective == "dpo":  # a cached reference's values (8 bytes a pair) are the data's: room for one pair
        step = dpo_task.build_dpo_step(cfg, mesh, tokenizer, num_pairs=1)
        inputs = (step.abstract, dpo_task.abstract_batch(cfg, step.batch_sharding))
    else:
        step = build_step(cfg, mesh, tokenizer)
        inputs = (step.abstract, abstract_batch(cfg, step.batch_sharding))  # with packed documents' segment ids too
    with activate(mesh, step.rules):
        lowered = step.train_step.lower(*inputs)
    m = cfg.model
    dtype = jax.numpy.dtype(resolve_dtype(m.dtype))
    tokens = cfg.train.batch_size * cfg.data.seq_len
    with activate(mesh, step.rules):
        split = context.current_split()
        impl = m.context_attention if split else attention.choose(
            m.attention, dtype=dtype, head_dim=m.d_head, seq_len=cfg.data.seq_len,
            segments=cfg.data.packing == "documents", sinks=m.attn_sinks)  # sinks: xla, counted by XLA
        tiles = splash_blocks.tiles_for(m.d_head, cfg.data.seq_len)  # the target chip's, with its measured rate
    # Causal attention's model FLOPs per token (workloads/lm/model/flops.py): what the kernel must do at the least.
    attention_flops = tokens * 3 * m.layers * cfg.data.seq_len * m.heads * attention_width(m)
    # The kernel's time at its measured rate; remat=full runs its forward (a third of the work) again.
    kernel_s = (attention_flops * (4 / 3 if m.remat == "full" else 1.0) / len(devices) / (tiles.tflops * 1e12)
                if impl == "splash" and tiles.tflops else None)
    remat = REMAT_POLICIES[m.remat]
    trainable = param_count(step.abstract.params)
    return StepProgram(
        lowered=lowered, argument_bytes=mesh_lib.bytes_per_device(inputs),
        params=trainable + param_count(step.abstract.frozen), trainable_params=trainable,
        optimizer_bytes=mesh_lib.bytes_per_device(step.abstract.opt_state),
        items_per_step=tokens, item_unit="tokens",
        model_flops_per_step=tokens * train_flops_per_token(m, step.vocab, cfg.data.seq_len)
        * (dpo_task.flops_factor(cfg) if cfg.objective == "dpo" else 1.0),
        dtype=str(dtype),
        kernel_flops=attention_flops if impl == "splash" else 0.0, kernel_s=kernel_s, memory_fix=preflight.MEMORY_FIX,
        kernel_note=("splash attention's FLOPs from the formula (a Pallas kernel: XLA counts it as 0; the kernel "
                     "also computes the diagonal blocks' masked half and recomputes scores in the backward pass)"),
        notes=(f"the formula (workloads/lm/model/flops.py) counts each matmul once and half of causal attention's T x T "
               f"scores; attention runs as {impl}" + _attention_memory(impl, split, cfg.data.seq_len) + f"; {remat}",
               *_moe_notes(cfg, mesh), *preflight.pipeline_notes(cfg, mesh), *_quant_notes(m, str(dtype))),
    )


def _quant_notes(m: ModelConfig, dtype: str) -> tuple[str, ...]:
    """What `systolic plan` should say about model.quant: the compiled step is the quantized one, its roofline is not."""
    if m.quant == "none":
        return ()
    return (f"model.quant={m.quant}: the projections' forward matmuls are {m.quant} x {m.quant} (the memory and bytes "
            f"are the quantized step's); the compute time is at the {dtype} peak, an upper bound where the chip "
            f"multiplies {m.quant} faster",)


def _attention_memory(impl: str, split, seq_len: int) -> str:
    """What the plan's note says about the attention scores each device holds."""
    if impl == "splash":
        return ""
    if split is None:
        return ", which computes all T x T scores and the mask"
    c = seq_len // (2 * split.n)
    if impl == "ring":
        rows = c // context.query_blocks(c)
        return (f" over mesh.context={split.n} (lm/parallel/context.py): key/value blocks round the ring, scores in blocks of "
                f"{rows} queries x {c} keys (T / 2n), recomputed in the backward pass")
    return (f" over mesh.context={split.n} (lm/parallel/context.py): keys/values gathered whole, each device's {2 * c} queries' "
            f"scores against all {seq_len} keys")


def _moe_notes(cfg: LMConfig, mesh) -> tuple[str, ...]:
    """What `systolic plan` should say about a mixture of experts: what the formula counts, and what the all-to-all
    bytes and XLA's FLOPs mean for the chosen dispatch (workloads/lm/model/moe.py)."""
    moe = cfg.model.moe
    if not moe.experts:
        return ()
    n = mesh.shape["expert"]
    notes = [f"MoE: {moe.top_k} of {moe.experts} experts per token in {len(cfg.model.moe_layers)} of "
             f"{cfg.model.layers} layers; the formula counts the active experts only"]
    if moe.capacity_factor:
        notes.append(f"capacity dispatch (factor {moe.capacity_factor:g}): XLA's count includes the one-hot "
                     "dispatch and combine einsums and the empty slots")
        return tuple(notes)
    if n > 1:
        slots = n * min(moe.top_k, moe.experts // n) / moe.top_k
        notes.append(f"dropless over mesh.expert={n}: the all-to-all sends fixed slots sized for the worst case, "
                     f"{slots:g}x the rows routed (XLA:CPU has no ragged all-to-all): an upper bound on the traffic")
    if compile_platform() != "tpu":  # GPU targets compile with XLA:CPU on this host too
        notes.append(f"XLA:CPU computes ragged_dot as one matmul per expert over all rows: its count holds "
                     f"{moe.experts}x the experts' FLOPs")
    return tuple(notes)


def generate(run_dir: Path, prompt: str | None, max_new_tokens: int | None, temperature: float | None,
             top_k: int | None, top_p: float | None, seed: int | None, *, chat: bool = False,
             system: str | None = None, quantize: str | None = None, kv_cache: str = "auto") -> str:
    return generate_lib.generate_from_run(run_dir, prompt=prompt, max_new_tokens=max_new_tokens,
                                          temperature=temperature,
                                    top_k=top_k, top_p=top_p, seed=seed, chat=chat, system=system, quantize=quantize,
                                    kv_cache=kv_cache)


def evaluate(run_dir: Path, *, data: str | None, choices: Path | None, batch_size: int | None,
             quantize: str | None) -> str:
    """`systolic eval lm RUN_DIR`: the report to print, the figures as JSON on its last line."""
    from systolic.workloads.lm.evaluate import evaluate_run

    return evaluate_run(run_dir, data=data, choices=choices, batch_size=batch_size, quantize=quantize)
