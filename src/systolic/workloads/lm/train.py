"""The `lm` workload: its train state, its loss, its evaluation, and the `Task` it hands the engine's loop (its
training text comes from corpus.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.data import packed, sft, text
from systolic.data.preference import PreferenceData
from systolic.data.stream import DeviceStream, place
from systolic.data.tokenizer import Tokenizer
from systolic.engine.loop import Task
from systolic.engine.state import TrainState, make_sharded_state, optimizer_shardings, param_count
from systolic.engine.step import CHECKED, jit_step, make_train_step
from systolic.observe.peak_flops import peak_flops
from systolic.optim.adamw import make_schedule
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import Rules, activate, logical_to_spec, rules_for
from systolic.workloads.lm import corpus, preflight
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.init_from import make_init_state
from systolic.workloads.lm.model import lora
from systolic.workloads.lm.model import moe as moe_lib
from systolic.workloads.lm.model.build import init_params, model_graphdef, param_shardings, trainable_split
from systolic.workloads.lm.model.config import PipelineConfig
from systolic.workloads.lm.model.flops import train_flops_per_token
from systolic.workloads.lm.model.layers import resolve_dtype
from systolic.workloads.lm.model.sections import MoeConfig
from systolic.workloads.lm.model.transformer import Transformer
from systolic.workloads.lm.optimizer import make_lm_optimizer
from systolic.workloads.lm.parallel import context

# STATE ----------------------------------------------------------------------------------------------


def make_state_fns(cfg: LMConfig, vocab: int, mesh: Mesh, rules: Rules, tx: optax.GradientTransformation):
    """Returns (init_state jitted, abstract_state, state_shardings); the state is born sharded. With model.lora
    the state's `params` are the adapters and its `frozen` the base weights, so the optimizer state exists for
    the adapters alone."""
    replicated = NamedSharding(mesh, P())
    p_shardings, f_shardings = trainable_split(cfg.model, param_shardings(cfg.model, vocab, mesh, rules))

    def fresh_state(params: dict[str, Any], frozen: dict[str, Any], rng: jax.Array) -> TrainState:
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng,
                          frozen=frozen)

    def make_state(key: jax.Array) -> TrainState:
        init_key, rng = jax.random.split(key)
        return fresh_state(*trainable_split(cfg.model, init_params(cfg.model, vocab, init_key)), rng)

    def shardings(abstract: TrainState) -> TrainState:
        opt_shardings = optimizer_shardings(abstract.opt_state, p_shardings, replicated)
        return TrainState(step=replicated, params=p_shardings, opt_state=opt_shardings, rng=replicated, extra={},
                          frozen=f_shardings)

    def start_from(source_params: dict[str, Any], key: jax.Array) -> TrainState:
        """The state of a run that starts from another run's parameters (the base, with model.lora)."""
        init_key, rng = jax.random.split(key)  # the same rng as a random start with this seed
        if not cfg.model.lora.rank:
            return fresh_state(source_params, {}, rng)
        # Fresh adapters drawn as make_state draws them; the random base weights beside them are dead code that
        # XLA drops.
        return fresh_state(lora.split(init_params(cfg.model, vocab, init_key))[0], source_params, rng)

    key = jax.random.PRNGKey(cfg.train.seed)
    state = make_sharded_state(make_state, (key,), shardings, lambda: activate(mesh, rules))
    init_state, abstract, shardings = state.init, state.abstract, state.shardings
    if cfg.init.from_:  # fine-tuning: another run's parameters instead of random ones
        source_params = abstract.frozen if cfg.model.lora.rank else abstract.params
        init_state = make_init_state(Path(cfg.init.from_), cfg.model, source_params, start_from, key, shardings,
                                     mesh, rules)
    return init_state, abstract, shardings



# LOSS AND EVALUATION ------------------------------------------------------------------------------------------


def batch_logits(model: Transformer, batch: dict[str, jax.Array], pipe: PipelineConfig | None = None) -> jax.Array:
    """The model's logits (B, T, V) float32 for a batch of `text` windows: within documents when the batch carries
    their segment ids and positions (data.packing=documents), else across the whole window; over the pipeline's
    stages with `pipe` on a mesh that has them."""
    return model(batch["inputs"], segment_ids=batch.get("segment_ids"), positions=batch.get("positions"),
                 pipeline=pipe)


def batch_keys(cfg: LMConfig) -> tuple[str, ...]:
    """The keys of a batch, each an int32 (B, seq_len) array: chat rows carry a loss mask besides the packed keys."""
    if cfg.data.format == "chat":
        return packed.BATCH_KEYS
    return text.batch_keys(packed=cfg.data.packing == "documents")


def abstract_batch(cfg: LMConfig, sharding: NamedSharding) -> dict[str, jax.ShapeDtypeStruct]:
    """What a global train batch looks like under `cfg.data`, for compiling the step without data."""
    shape = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len), jnp.int32, sharding=sharding)
    return {key: shape for key in batch_keys(cfg)}


def token_losses(model: Transformer, batch: dict[str, jax.Array], pipe: PipelineConfig | None = None) -> jax.Array:
    """Each target's cross-entropy (B, T) float32."""
    return cross_entropy_and_log_z(batch_logits(model, batch, pipe), batch["targets"])[0]


def cross_entropy_and_log_z(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits (B, T, V) float32, targets (B, T) int32 -> (cross-entropy (B, T), log Z (B, T)), where log Z is the
    log of the softmax's normaliser, logsumexp over the vocabulary: the cross-entropy's own first term, so log Z
    costs nothing extra (this is what optax.softmax_cross_entropy_with_integer_labels computes)."""
    log_z = jax.nn.logsumexp(logits, axis=-1)  # (B, T)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, T)
    return log_z - target_logits, log_z


def objective(ce: jax.Array, log_z: jax.Array, mask: jax.Array | None, z_loss: float) -> tuple[jax.Array, dict]:
    """The training loss from per-target cross-entropies and log Z, each (B, T) float32: their mean over the targets
    to learn (all, or where `mask` (B, T) float32 is 1), plus `z_loss` times the mean of log(Z)^2 (PaLM's auxiliary
    loss: it keeps the softmax normaliser near 1, so logits cannot drift upwards together where bfloat16 loses
    precision). Returns (loss, metrics): `log_z`, the mean log Z (watched for drift whatever the weight), and with
    z_loss > 0 `z_loss`, the weighted term included in the loss."""

    def mean(x):  # under jit the sums run over the global batch, so every device divides by the same count
        return x.mean() if mask is None else (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    loss, metrics = mean(ce), {"log_z": mean(log_z)}
    if z_loss:
        metrics["z_loss"] = z_loss * mean(jnp.square(log_z))
        loss = loss + metrics["z_loss"]
    return loss, metrics


def loss_terms(batch: dict[str, jax.Array]) -> jax.Array:
    """How many targets of a chat batch are in its loss () float32: what a micro-batch's mean counts for when
    train.grad_accum > 1 (engine/step.py), so the step's loss is the mean over all of the batch's assistant tokens."""
    return batch["loss_mask"].sum().astype(jnp.float32)


def model_params(state: TrainState) -> dict[str, Any]:
    """The whole model's parameters of a train state: with model.lora its adapters put back beside the frozen base."""
    return lora.combine(state.params, state.frozen)


def make_loss_fn(graphdef: nnx.GraphDef, moe: MoeConfig, z_loss: float, pipe: PipelineConfig | None = None):
    """The lm's `loss_fn(params, batch, key, frozen=None) -> (loss, metrics)` for the engine's step: `objective`'s
    cross-entropy (and z-loss), plus with model.moe the MoE layers' load-balancing loss and router z-loss (averaged
    over the layers) by their weights; their values and the experts' load in the metrics. With `pipe` the layers
    run as a pipeline when the mesh has stages (lm/parallel/pipeline.py)."""

    def loss_fn(params: Any, batch: dict[str, jax.Array], key: jax.Array,
                frozen: dict[str, Any] | None = None) -> tuple[jax.Array, dict]:
        del key  # no dropout
        model = nnx.merge(graphdef, lora.combine(params, frozen or {}))
        logits, stats = model.with_moe_stats(batch["inputs"], segment_ids=batch.get("segment_ids"),
                                             positions=batch.get("positions"), pipeline=pipe)  # (B, T, V) float32
        ce, log_z = cross_entropy_and_log_z(logits, batch["targets"])  # (B, T) each
        # Chat rows: the mean over the targets to learn (assistant tokens); the padding and prompts are not in it.
        mask = batch["loss_mask"].astype(jnp.float32) if "loss_mask" in batch else None  # (B, T)
        loss, metrics = objective(ce, log_z, mask, z_loss)
        if stats is None:
            return loss, metrics
        router, router_metrics = router_terms(moe, stats)
        return loss + router, {**metrics, "moe/ce": loss, **router_metrics}

    return loss_fn


def router_terms(moe: MoeConfig, stats: moe_lib.MoeStats | None) -> tuple[jax.Array | float, dict]:
    """What an MoE model adds to any objective's loss (SFT's, DPO's, GRPO's): the layers' load-balancing loss and
    router z-loss (averaged over the layers) by their weights, and their metrics with the experts' load; (0, {})
    for a dense model. Without them post-training is free to collapse the routing that pretraining balanced."""
    if stats is None:
        return 0.0, {}
    router = moe.aux_loss_weight * jnp.mean(stats.aux_loss) + moe.z_loss_weight * jnp.mean(stats.z_loss)
    return router, moe_lib.metrics(stats, capacity=moe.capacity_factor > 0)


def make_eval_step(graphdef: nnx.GraphDef, pipe: PipelineConfig | None = None):
    @jax.jit
    def eval_step(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """(the batch's summed cross-entropy () float32, the number of targets it sums over () int32)."""
        ce = token_losses(nnx.merge(graphdef, params), batch, pipe)  # (B, T)
        if "loss_mask" not in batch:
            return ce.sum(), jnp.asarray(ce.size, jnp.int32)
        mask = batch["loss_mask"]  # (B, T) int32
        return (ce * mask.astype(jnp.float32)).sum(), mask.sum()

    return eval_step


def make_evaluate(graphdef: nnx.GraphDef, eval_batches: list[Any], bytes_per_token: float | None,
                  pipe: PipelineConfig | None = None):
    """The validation loss in nats per target token, and with `bytes_per_token` (text) per UTF-8 byte. Chat data
    reports nats per assistant token only: its held-out text is mostly prompts, which are not in the loss."""
    eval_step = make_eval_step(graphdef, pipe)

    def evaluate(state: TrainState) -> dict[str, float]:
        params = model_params(state)
        sums = [eval_step(params, b) for b in eval_batches]
        total, count = jax.device_get((sum(s for s, _ in sums), sum(c for _, c in sums)))  # summed on device, one fetch
        nats_per_token = float(total) / float(count)
        if bytes_per_token is None:
            return {"loss": nats_per_token}
        nats_per_byte = nats_per_token / bytes_per_token
        return {"loss": nats_per_token, "nats_per_byte": nats_per_byte, "bits_per_byte": nats_per_byte / math.log(2)}

    return evaluate


# THE TASK -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BuiltLMTask:
    """What `build_task` returns: the engine's `Task`, and beside it what the entry reports at the start (sizes,
    data) and uses at the end (the model's structure for sampling, the corpus for the unigram baseline)."""

    task: Task
    mesh: Mesh
    rules: Rules
    corpus: corpus.Corpus | sft.ChatCorpus | PreferenceData  # by data.format; objective=dpo: preference pairs
    vocab: int
    graphdef: nnx.GraphDef
    param_count: int
    trainable_count: int  # the adapters' with model.lora, else param_count


@dataclasses.dataclass
class Step:
    """The model's train step on a mesh, with no data attached: what `train`, `bench` and `plan` share."""

    rules: Rules
    vocab: int
    graphdef: nnx.GraphDef
    init: Any
    abstract: TrainState
    train_step: Any  # jitted, with explicit shardings and the state donated
    batch_sharding: NamedSharding


def check_step(cfg: LMConfig, mesh: Mesh, tokenizer: Tokenizer) -> tuple[Rules, int]:
    """Everything checkable about a train step on `mesh`, checked before any data is read or anything compiles.
    Returns the sharding rules and the vocabulary: the embedding has a row for each of `tokenizer`'s ids (padded:
    `model.padded_vocab`)."""
    rules = rules_for(cfg.sharding.rules, mesh)
    mesh_lib.check_batch(cfg.train.batch_size, cfg.train.grad_accum, mesh)
    preflight.check_pipeline(cfg, mesh)
    with activate(mesh, rules):
        context.check_seq_len(cfg.data.seq_len, context.current_split())
    vocab = cfg.model.padded_vocab(tokenizer.vocab_size)
    preflight.check_training_fits(cfg, vocab, list(mesh.devices.flat))  # before eval_shape traces every layer
    return rules, vocab


def build_step(cfg: LMConfig, mesh: Mesh, tokenizer: Tokenizer, *, tx: optax.GradientTransformation | None = None
               ) -> Step:
    """The next-token step (`check_step` first), with `tx` as its optimizer (default: `make_lm_optimizer`'s for
    `cfg`; benchmarks/studies/muon_collectives.py passes one with Optax's Muon inside)."""
    rules, vocab = check_step(cfg, mesh, tokenizer)
    schedule = make_schedule(cfg.optim, cfg.train.steps)  # lr(t): the optimizer's and the logged metric's
    tx = make_lm_optimizer(cfg.optim, cfg.model, schedule) if tx is None else tx
    init, abstract, shardings = make_state_fns(cfg, vocab, mesh, rules, tx)
    graphdef = model_graphdef(cfg.model, vocab)
    step_fn = make_train_step(make_loss_fn(graphdef, cfg.model.moe, cfg.optim.z_loss, cfg.pipeline), tx, schedule,
                              cfg.train.grad_accum, loss_terms=loss_terms if cfg.data.format == "chat" else None)
    batch_shard = NamedSharding(mesh, logical_to_spec(("batch", "seq"), rules))
    train_step = jit_step(step_fn, state_shardings=shardings, batch_sharding=batch_shard, mesh=mesh, loop=cfg.loop,
                          check=CHECKED)
    return Step(rules, vocab, graphdef, init, abstract, train_step, batch_shard)


def build_task(cfg: LMConfig, mesh: Mesh, tokenizer: Tokenizer) -> BuiltLMTask:
    """The train task of `cfg` on `mesh`, its data read and encoded by `tokenizer` (data.tokenizer's, opened once
    where the run starts)."""
    step = build_step(cfg, mesh, tokenizer)
    rules, vocab, graphdef, init, abstract = step.rules, step.vocab, step.graphdef, step.init, step.abstract
    train_step, batch_shard = step.train_step, step.batch_sharding
    data = (sft.load_chat_corpus(cfg.data.path, tokenizer, seq_len=cfg.data.seq_len, val_percent=cfg.data.val_percent)
            if cfg.data.format == "chat" else corpus.load_corpus(cfg, tokenizer))

    # Each process reads only the rows of the global batch that its devices hold.
    lo, hi = mesh_lib.local_rows(batch_shard, cfg.train.batch_size)
    shares = dict(global_batch=cfg.train.batch_size, seed=cfg.train.seed, process_index=lo // (hi - lo),
                  process_count=cfg.train.batch_size // (hi - lo))
    eval_batch = cfg.train.batch_size // cfg.train.grad_accum
    if isinstance(data, sft.ChatCorpus):
        iterator = packed.make_train_iterator(data.train, **shares)
        host_eval = packed.make_eval_batches(data.val, batch=eval_batch, num_batches=cfg.train.eval_batches)
        bytes_per_token = None  # chat reports nats per assistant token (make_evaluate)
    else:
        # The end-of-document id marks where documents start in a window, for batches that keep attention within them.
        eot_id = tokenizer.eot_id if cfg.data.packing == "documents" else None
        shares |= dict(seq_len=cfg.data.seq_len, eot_id=eot_id)
        if data.mixture:
            iterator = text.make_mixture_iterator([t for _, t, _ in data.mixture], [w for _, _, w in data.mixture],
                                                  **shares)
        else:
            iterator = text.make_train_iterator(data.train_tokens, **shares)
        host_eval = text.make_eval_batches(data.val_tokens, seq_len=cfg.data.seq_len, batch=eval_batch,
                                           num_batches=cfg.train.eval_batches, eot_id=eot_id)
        bytes_per_token = data.val_bytes / len(data.val_tokens)
    lo, hi = mesh_lib.local_rows(batch_shard, eval_batch)
    eval_batches = [place({k: v[lo:hi] for k, v in b.items()}, batch_shard, eval_batch) for b in host_eval]

    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    compute = str(jnp.dtype(resolve_dtype(cfg.model.dtype)))
    peak = peak_flops(dtype=compute)
    task = Task(
        workload="lm",
        abstract_state=abstract,
        init_state=init,
        train_step=train_step,
        data=DeviceStream(iterator, batch_shard, cfg.train.batch_size),
        check=CHECKED,
        evaluate=make_evaluate(graphdef, eval_batches, bytes_per_token, cfg.pipeline),
        items_per_step=tokens_per_step,
        item_unit="tokens",
        flops_per_step=tokens_per_step * train_flops_per_token(cfg.model, vocab, cfg.data.seq_len),
        peak_flops=peak * jax.device_count() if peak else None,
        meta={"workload": "lm", "vocab": vocab},
        memory_advice=preflight.MEMORY_FIX,
        step_metrics=(corpus.mixture_metrics(data, cfg.train.batch_size, cfg.data.seq_len)
                      if isinstance(data, corpus.Corpus) and data.mixture else None),
        notes=preflight.pipeline_notes(cfg, mesh),
    )
    trainable = param_count(abstract.params)
    return BuiltLMTask(task=task, mesh=mesh, rules=rules, corpus=data, vocab=vocab, graphdef=graphdef,
                       param_count=trainable + param_count(abstract.frozen), trainable_count=trainable)
