"""The DPO train task (`systolic train lm --recipe dpo init.from=RUN data.path=pairs.jsonl`): the policy starts as
the init.from model and learns from preference pairs (data/preference.py) against a frozen reference, that same model.

Where the reference's weights live, by model.lora and dpo.reference: with model.lora the reference is the model
without adapters on the base weights already in `TrainState.frozen` (no second copy); full fine-tuning with
dpo.reference=live keeps a copy of the init.from weights in `frozen` (twice the parameters' memory; checkpoints
leave it out and a resumed run reads it again from init.from); dpo.reference=cached keeps no reference weights.

dpo.reference=cached computes the reference's log-probabilities of every pair once, before the first step, and
keeps them in `TrainState.extra`, so a resumed run reads exactly the values it started with. dpo.reference=live runs
the reference's forward pass on each batch (no gradient flows through it). The step is the engine's
(`make_train_step` under `jit_step`); with train.grad_accum > 1 the micro-batches weigh by their pairs, so the loss
is the mean over all the batch's pairs. Each case in detail: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.data import packed
from systolic.data.stream import DeviceStream, place
from systolic.data.tokenizer import Tokenizer
from systolic.engine.loop import Task
from systolic.engine.state import TrainState, param_count
from systolic.engine.step import CHECKED, jit_step, make_train_step
from systolic.observe.peak_flops import peak_flops
from systolic.optim.adamw import make_schedule
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import logical_to_spec
from systolic.workloads.lm import train
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm import preflight
from systolic.workloads.lm.model import build, lora
from systolic.workloads.lm.model.flops import train_flops_per_token
from systolic.workloads.lm.model.layers import resolve_dtype
from systolic.workloads.lm.optimizer import make_lm_optimizer
from systolic.data import preference
from systolic.workloads.lm.post import dpo
from systolic.workloads.lm.post.logps import token_logps

CACHE = "reference_logps"  # TrainState.extra's key of the cached reference log-probabilities (pairs, 2)


def keeps_reference_copy(cfg: LMConfig) -> bool:
    """Whether the state holds a second copy of the weights as the reference (full fine-tuning, live reference)."""
    return cfg.dpo.reference == "live" and not cfg.model.lora.rank


def flops_factor(cfg: LMConfig) -> float:
    """Model FLOPs of a DPO step over a next-token step's on the same tokens: a live reference adds one forward
    pass, a third of the forward and backward passes."""
    return 4 / 3 if cfg.dpo.reference == "live" else 1.0


def policy_params(cfg: LMConfig, state: TrainState) -> dict[str, Any]:
    """The trained model's parameters: with model.lora its adapters beside the frozen base."""
    return state.params if keeps_reference_copy(cfg) else train.model_params(state)


# SEQUENCE LOG-PROBABILITIES AND THE LOSS ----------------------------------------------------------------------


def _sums(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array], pairs: int, pipe, *,
          with_logits: bool) -> tuple[Any, ...]:
    """The model's sequence log-probabilities (B, K, 2); with_logits also the completions' lengths and their
    vocabulary-mean logits summed, each (B, K, 2), and the MoE layers' stats (None for a dense model)."""
    model = nnx.merge(graphdef, params)
    logits, stats = model.with_moe_stats(batch["inputs"], segment_ids=batch["segment_ids"],
                                         positions=batch["positions"], pipeline=pipe)  # (B, T, V) float32
    sequence = batch["sequence"]  # (B, T)
    logps = dpo.sequence_sums(token_logps(logits, batch["targets"]), sequence, pairs)  # (B, K, 2)
    if not with_logits:
        return (logps,)
    lengths = dpo.sequence_sums(jnp.ones(sequence.shape, jnp.float32), sequence, pairs)  # (B, K, 2)
    return logps, lengths, dpo.sequence_sums(logits.mean(axis=-1), sequence, pairs), stats


def with_cached_reference(batch: dict[str, jax.Array], extra: dict[str, jax.Array], pairs: int) -> dict:
    """The batch with `reference` (B, K, 2): its pairs' cached reference log-probabilities (0 for empty slots)."""
    ids = batch["pair_ids"][:, :pairs]  # (B, K)
    cached = jnp.take(extra[CACHE], jnp.maximum(ids, 0), axis=0)  # (B, K, 2)
    return {**batch, "reference": jnp.where((ids >= 0)[..., None], cached, 0.0)}


def make_pair_fn(cfg: LMConfig, vocab: int):
    """`pair_fn(params, batch, frozen) -> (policy, reference, lengths, mean_logits, valid, stats)`: the (B, K, 2)
    sequence log-probabilities of the policy and the reference, the completions' lengths and summed mean logits,
    `valid` (B, K) float32, 1 for the slots that hold a pair, and the policy's MoE stats (None for a dense model). A
    cached reference comes in the batch."""
    graphdef = build.model_graphdef(cfg.model, vocab)
    ref_graphdef = build.model_graphdef(lora.base_config(cfg.model), vocab)  # the model without adapters
    pairs, live, pipe = preference.pair_slots(cfg.data.seq_len), cfg.dpo.reference == "live", cfg.pipeline

    def pair_fn(params: Any, batch: dict[str, jax.Array], frozen: dict[str, Any]):
        policy_weights = lora.combine(params, frozen) if cfg.model.lora.rank else params
        policy, lengths, mean_logits, stats = _sums(graphdef, policy_weights, batch, pairs, pipe, with_logits=True)
        if live:  # the frozen weights: the base of a LoRA run, else the copy of init.from kept beside the policy
            (reference,) = _sums(ref_graphdef, jax.lax.stop_gradient(frozen), batch, pairs, pipe, with_logits=False)
        else:
            reference = batch["reference"]
        valid = (batch["pair_ids"][:, :pairs] >= 0).astype(jnp.float32)  # (B, K)
        return policy, reference, lengths, mean_logits, valid, stats

    return pair_fn


def make_dpo_loss_fn(cfg: LMConfig, vocab: int):
    """The engine's `loss_fn(params, batch, key, frozen=None) -> (loss, metrics)`: the mean DPO loss over the
    batch's pairs, TRL's metrics beside it; an MoE policy adds its router losses (train.router_terms; the DPO
    loss alone is `moe/dpo`)."""
    pair_fn = make_pair_fn(cfg, vocab)

    def loss_fn(params: Any, batch: dict[str, jax.Array], key: jax.Array,
                frozen: dict[str, Any] | None = None) -> tuple[jax.Array, dict]:
        del key  # no dropout
        policy, reference, lengths, mean_logits, valid, stats = pair_fn(params, batch, frozen or {})
        loss = dpo.masked_mean(dpo.pair_losses(policy, reference, lengths, cfg.dpo), valid)
        router, router_metrics = train.router_terms(cfg.model.moe, stats)
        metrics = {**dpo.reward_metrics(policy, reference, valid, cfg.dpo.beta),
                   **dpo.logit_metrics(mean_logits, lengths), **router_metrics}
        return (loss + router, {**metrics, "moe/dpo": loss}) if stats is not None else (loss, metrics)

    return loss_fn


def pair_count(batch: dict[str, jax.Array]) -> jax.Array:
    """How many pairs a (micro-)batch holds () float32: what its mean loss counts for under train.grad_accum."""
    return (batch["pair_ids"][:, : batch["pair_ids"].shape[1] // 2] >= 0).sum().astype(jnp.float32)


# THE STEP AND ITS STATE ---------------------------------------------------------------------------------------


def build_dpo_step(cfg: LMConfig, mesh: Mesh, tokenizer: Tokenizer, num_pairs: int) -> train.Step:
    """The DPO step on `mesh`, no data attached; with a cached reference the state's `extra` has room for
    `num_pairs` pairs' values, which `Step.init` leaves at zero (`make_cache` fills them)."""
    rules, vocab = train.check_step(cfg, mesh, tokenizer)
    schedule = make_schedule(cfg.optim, cfg.train.steps)  # lr(t): the optimizer's and the logged metric's
    tx = make_lm_optimizer(cfg.optim, cfg.model, schedule)
    init, abstract, shardings = train.make_state_fns(cfg, vocab, mesh, rules, tx)
    replicated = NamedSharding(mesh, P())
    if keeps_reference_copy(cfg):
        copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params)
        init = _then(init, lambda state: state.replace(frozen=copy(state.params)))
        abstract, shardings = (s.replace(frozen=s.params) for s in (abstract, shardings))
    pairs = preference.pair_slots(cfg.data.seq_len)
    if cfg.dpo.reference == "cached":
        zeros = jax.jit(lambda: jnp.zeros((num_pairs, 2), jnp.float32), out_shardings=replicated)
        init = _then(init, lambda state: state.replace(extra={CACHE: zeros()}))
        abstract = abstract.replace(extra={CACHE: jax.ShapeDtypeStruct((num_pairs, 2), jnp.float32,
                                                                        sharding=replicated)})
        shardings = shardings.replace(extra={CACHE: replicated})
    inner = make_train_step(make_dpo_loss_fn(cfg, vocab), tx, schedule,
                            cfg.train.grad_accum, loss_terms=pair_count)

    def dpo_step(state: TrainState, batch: dict[str, jax.Array]):
        if cfg.dpo.reference == "cached":
            batch = with_cached_reference(batch, state.extra, pairs)
        return inner(state, batch)

    batch_shard = NamedSharding(mesh, logical_to_spec(("batch", "seq"), rules))
    train_step = jit_step(dpo_step, state_shardings=shardings, batch_sharding=batch_shard, mesh=mesh,
                          loop=cfg.loop, check=CHECKED)
    return train.Step(rules, vocab, build.model_graphdef(cfg.model, vocab), init, abstract, train_step, batch_shard)


def _then(init: Callable[[], TrainState], then: Callable[[TrainState], TrainState]) -> Callable[[], TrainState]:
    return lambda: then(init())


def abstract_batch(cfg: LMConfig, sharding: NamedSharding) -> dict[str, jax.ShapeDtypeStruct]:
    """What a global DPO batch looks like, for compiling the step without data."""
    shape = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len), jnp.int32, sharding=sharding)
    return {key: shape for key in preference.BATCH_KEYS}


def make_cache(cfg: LMConfig, vocab: int, batches: list[dict[str, jax.Array]], num_pairs: int, mesh: Mesh):
    """`cache(state) -> state` for dpo.reference=cached: the reference's sequence log-probabilities of every pair
    of `batches` (placed global batches covering every pair once), computed with the state's weights before the
    first step (the policy is still the reference then; with model.lora, the base without adapters) and kept in
    `extra`."""
    ref_graphdef = build.model_graphdef(lora.base_config(cfg.model), vocab)
    pairs = preference.pair_slots(cfg.data.seq_len)
    replicated = NamedSharding(mesh, P())

    @jax.jit
    def reference_sums(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        (sums,) = _sums(ref_graphdef, params, batch, pairs, cfg.pipeline, with_logits=False)
        return jax.lax.with_sharding_constraint((sums, batch["pair_ids"][:, :pairs]), replicated)

    def cache(state: TrainState) -> TrainState:
        weights = state.frozen if cfg.model.lora.rank else state.params
        values = np.zeros((num_pairs, 2), np.float32)
        for batch in batches:
            sums, ids = jax.device_get(reference_sums(weights, batch))  # (B, K, 2), (B, K)
            values[ids[ids >= 0]] = sums[ids >= 0]
        return state.replace(extra={CACHE: jax.device_put(values, replicated)})

    return cache


# EVALUATION ---------------------------------------------------------------------------------------------------


def make_dpo_evaluate(cfg: LMConfig, vocab: int, eval_batches: list[dict[str, jax.Array]]):
    """The held-out pairs' mean DPO loss, preference accuracy (`rewards/accuracies`, the share of pairs whose
    chosen completion gets the higher reward) and mean reward margin."""
    pair_fn = make_pair_fn(cfg, vocab)
    pairs = preference.pair_slots(cfg.data.seq_len)

    @jax.jit
    def eval_step(params: Any, frozen: Any, extra: Any, batch: dict[str, jax.Array]) -> jax.Array:
        """(summed loss, correct pairs, summed margin, pairs) (4,) float32 of the batch."""
        if cfg.dpo.reference == "cached":
            batch = with_cached_reference(batch, extra, pairs)
        policy, reference, lengths, _, valid, _ = pair_fn(params, batch, frozen)
        losses = dpo.pair_losses(policy, reference, lengths, cfg.dpo)  # (B, K)
        rewards = cfg.dpo.beta * (policy - reference)  # (B, K, 2)
        margins = rewards[..., 0] - rewards[..., 1]  # (B, K)
        return jnp.stack([(losses * valid).sum(), ((margins > 0).astype(jnp.float32) * valid).sum(), (margins * valid).sum(),
                          valid.sum()])

    def evaluate(state: TrainState) -> dict[str, float]:
        sums = sum(eval_step(state.params, state.frozen, state.extra, b) for b in eval_batches)
        loss, correct, margin, count = (float(x) for x in jax.device_get(sums))  # summed on device, one fetch
        return {"loss": loss / count, "rewards/accuracies": correct / count, "rewards/margins": margin / count}

    return evaluate


# THE TASK -----------------------------------------------------------------------------------------------------


def _placed_batches(rows: preference.PreferenceRows, batch: int, sharding: NamedSharding,
                    num_batches: int | None = None) -> list[dict[str, jax.Array]]:
    """Batches of `batch` rows placed on the mesh: every row (num_batches None), or at most `num_batches` batches
    of rows spread evenly (packed.make_eval_batches' rule); empty rows fill the last batch."""
    lo, hi = mesh_lib.local_rows(sharding, batch)
    host = packed.make_eval_batches(rows, batch=batch, num_batches=num_batches or -(-len(rows) // batch))
    return [place({k: v[lo:hi] for k, v in b.items()}, sharding, batch) for b in host]


def build_dpo_task(cfg: LMConfig, mesh: Mesh, tokenizer: Tokenizer) -> train.BuiltLMTask:
    """The DPO task of `cfg` on `mesh`: the pairs at data.path read and encoded by `tokenizer` (the run's)."""
    data = preference.load_preferences(cfg.data.path, tokenizer, seq_len=cfg.data.seq_len,
                                       val_percent=cfg.data.val_percent)
    step = build_dpo_step(cfg, mesh, tokenizer, data.num_pairs)
    lo, hi = mesh_lib.local_rows(step.batch_sharding, cfg.train.batch_size)
    iterator = packed.make_train_iterator(data.train, global_batch=cfg.train.batch_size, seed=cfg.train.seed,
                                          process_index=lo // (hi - lo),
                                          process_count=cfg.train.batch_size // (hi - lo))
    eval_batch = cfg.train.batch_size // cfg.train.grad_accum
    eval_batches = _placed_batches(data.val, eval_batch, step.batch_sharding, cfg.train.eval_batches)
    init = step.init
    if cfg.dpo.reference == "cached":
        every_pair = [b for rows in (data.train, data.val)
                      for b in _placed_batches(rows, eval_batch, step.batch_sharding)]
        init = _then(init, make_cache(cfg, step.vocab, every_pair, data.num_pairs, mesh))
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    peak = peak_flops(dtype=str(jnp.dtype(resolve_dtype(cfg.model.dtype))))
    task = Task(
        workload="lm",
        abstract_state=step.abstract,
        init_state=init,
        train_step=step.train_step,
        data=DeviceStream(iterator, step.batch_sharding, cfg.train.batch_size),
        check=CHECKED,
        evaluate=make_dpo_evaluate(cfg, step.vocab, eval_batches),
        items_per_step=tokens_per_step,
        item_unit="tokens",
        flops_per_step=tokens_per_step * train_flops_per_token(cfg.model, step.vocab, cfg.data.seq_len)
        * flops_factor(cfg),
        peak_flops=peak * jax.device_count() if peak else None,
        meta={"workload": "lm", "vocab": step.vocab},
        progress_keys=("loss", "rewards/accuracies"),
        memory_advice=preflight.MEMORY_FIX,
        notes=preflight.pipeline_notes(cfg, mesh),
    )
    trainable = param_count(step.abstract.params)
    frozen = 0 if keeps_reference_copy(cfg) else param_count(step.abstract.frozen)  # the model's, not the copy
    return train.BuiltLMTask(task=task, mesh=mesh, rules=step.rules, corpus=data, vocab=step.vocab,
                             graphdef=step.graphdef, param_count=trainable + frozen, trainable_count=trainable)
