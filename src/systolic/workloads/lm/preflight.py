"""What a training run's config asks of its machine, checked before anything is traced: memory and the pipeline.

The memory here is a lower bound from the config alone (tracing a config with d_model = 10^7 would take minutes
before the allocation failed): float32 parameters, and for the trained ones a float32 gradient and the optimizer's
moments in `optim.moment_dtype` (AdamW keeps two; Muon one for the hidden matrices, counted for all as a lower
bound), plus what the backward pass keeps of one micro-batch (model/sizes.py `activation_floats`). The pipeline's
checks are everything about mesh.stage and the `pipeline` section that can be wrong, as one ConfigError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from systolic.errors import ConfigError
from systolic.runtime import memory
from systolic.runtime import mesh as mesh_lib
from systolic.workloads.lm.config import LMConfig, LMOptimConfig
from systolic.workloads.lm.model.flops import lora_params
from systolic.workloads.lm.model.sizes import activation_floats, param_count
from systolic.workloads.lm.parallel import pipeline

PARAM_BYTES = 4  # parameters stay float32 whatever model.dtype computes in
GRAD_BYTES = 4  # a float32 gradient per trained parameter
# What to change when a train step does not fit: this bound's refusal, the compiled step's (engine/fit.py), a plan's.
MEMORY_FIX = ("set model.remat=full (recompute activations in the backward pass), lower train.batch_size to the largest "
              "that fits (`systolic plan lm --target <slice> --search` finds it; or raise train.grad_accum), use more "
              "chips (a larger mesh.fsdp), keep the optimizer's moments in bfloat16 (optim.moment_dtype=bfloat16), "
              "or shrink the model (model.d_model, model.layers, model.mlp_dim, model.moe.experts, model.lora.rank).")


def training_bytes(cfg: LMConfig, vocab: int) -> int:
    """A lower bound on the memory a train step of `cfg` needs, over all devices."""
    total = param_count(cfg.model, vocab)
    trained = lora_params(cfg.model) if cfg.model.lora.rank else total
    micro_batch = cfg.train.batch_size // cfg.train.grad_accum
    tokens = micro_batch * cfg.data.seq_len
    per_trained = GRAD_BYTES + moment_bytes(cfg.optim)
    return PARAM_BYTES * total + per_trained * trained + tokens * 4 * activation_floats(cfg.model)


def moment_bytes(cfg: LMOptimConfig) -> int:
    """The optimizer's bytes per trained parameter, at least: AdamW's two moments, or Muon's one (the hidden
    matrices' momentum; AdamW's two for the rest are left out), each in `moment_dtype`."""
    return (2 if cfg.name == "adamw" else 1) * jnp.dtype(cfg.moment_dtype).itemsize


def check_training_fits(cfg: LMConfig, vocab: int, devices: Sequence[Any]) -> None:
    """A UserError, before any tracing, when the model cannot be trained in the memory of `devices`."""
    m = cfg.model
    params = param_count(m, vocab)
    memory.check_fits(
        training_bytes(cfg, vocab), devices,
        what=(f"Training this lm ({params:,} parameters: model.d_model={m.d_model}, model.layers={m.layers}, "
              f"vocabulary {vocab:,}{f', model.moe.experts={m.moe.experts}' if m.moe.experts else ''}; float32 "
              f"parameters and gradients, {cfg.optim.moment_dtype} optimizer moments, and a micro-batch's activations "
              "kept for the backward pass)"),
        fix=MEMORY_FIX,
    )


def pipeline_notes(cfg: LMConfig, mesh: Mesh) -> tuple[str, ...]:
    """What `systolic plan` and `bench` say about the pipeline: nothing without one."""
    stages = mesh.shape[pipeline.AXIS]
    if stages == 1:
        return ()
    return (pipeline.describe(stages, cfg.pipeline.microbatches, cfg.pipeline.repeats) + "; validation runs the same "
            "pipeline, generation does not (every device runs every layer)",)


def check_pipeline(cfg: LMConfig, mesh: Mesh) -> None:
    """Everything about the pipeline that can be wrong, as one ConfigError before anything compiles."""
    stages, pipe, model = mesh.shape[pipeline.AXIS], cfg.pipeline, cfg.model
    if stages == 1:
        if pipe.microbatches != 1 or pipe.repeats != 1:
            raise ConfigError(
                f"pipeline.microbatches={pipe.microbatches} pipeline.repeats={pipe.repeats} with mesh.stage=1: there "
                "is no pipeline for them to schedule. Fix: split the layers into stages (e.g. mesh.stage=2 "
                "mesh.data=-1), or set pipeline.microbatches=1 pipeline.repeats=1 (train.grad_accum splits a batch "
                "without a pipeline).")
        return
    problem = None
    micro_rows = cfg.train.batch_size // cfg.train.grad_accum
    groups = stages * pipe.repeats
    dp = mesh_lib.data_parallel_size(mesh) // stages  # inside the pipeline every stage sees the same rows
    if not model.scan_layers:
        problem = ("the layers are a list (model.scan_layers=false), but the stages split the stacked `layers` axis",
                   "model.scan_layers=true")
    elif model.moe.experts:
        problem = ("the MoE layers' router statistics are not carried through the pipeline yet",
                   "a dense model (model.moe.experts=0) or mesh.stage=1 (expert parallelism works without stages)")
    elif len(set(model.local_layers)) > 1 or len(set(model.rope_layers)) > 1:
        problem = ("model.layer_types mixes sliding and full layers (or model.no_rope_layers RoPE and NoPE layers), "
                   "and a stage runs its layers without their kinds",
                   "mesh.stage=1 (split the model with mesh.fsdp or mesh.tensor), or one kind of layer")
    elif model.layers % groups:
        problem = (f"model.layers={model.layers} does not split into mesh.stage x pipeline.repeats = {groups} equal "
                   "groups of layers", f"model.layers a multiple of {groups}, or a mesh.stage / pipeline.repeats "
                   f"that divides {model.layers}")
    elif micro_rows % pipe.microbatches or (micro_rows // pipe.microbatches) % dp:
        problem = (f"train.batch_size={cfg.train.batch_size} (train.grad_accum={cfg.train.grad_accum}) does not cut "
                   f"into {pipe.microbatches} microbatches whose rows split evenly over the {dp} data-parallel "
                   "devices", f"train.batch_size a multiple of {dp * pipe.microbatches * cfg.train.grad_accum}, or "
                   "fewer pipeline.microbatches")
    elif pipe.repeats > 1 and pipe.microbatches < stages:
        problem = (f"the circular schedule (pipeline.repeats={pipe.repeats}) sends microbatch m from the last stage "
                   f"back to the first, which needs it again {pipe.microbatches} ticks after it first took it, but "
                   f"it takes {stages} ticks to get round", f"pipeline.microbatches >= {stages}")
    if problem:
        raise ConfigError(
            f"Pipeline over mesh.stage={stages} with pipeline.microbatches={pipe.microbatches} and "
            f"pipeline.repeats={pipe.repeats}: {problem[0]}. Fix: {problem[1]}.")
