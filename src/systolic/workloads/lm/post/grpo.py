"""GRPO (lm objective=grpo, `systolic train lm --recipe grpo`): the task the engine's loop runs, and the run around it.

Each step trains on train.batch_size completions, grpo.group_size for each of train.batch_size / group_size prompts,
sampled by the serving engine with the policy's weights of the step before (post/rollout.py), scored by the reward
section's functions (post/rewards.py) and turned into group-relative advantages; grpo.num_iterations steps reuse one
rollout; a row holds the longest prompt and grpo.max_completion_len (post/rollout.py's row_length), not
data.seq_len, which only caps it. The loss is TRL's clipped surrogate (post/grpo_loss.py) on the policy's
log-probabilities at grpo.temperature (post/logps.py), with the k3 KL penalty against the reference policy
(init.from; with model.lora its base weights, the state's frozen parameters, so no second copy) when grpo.beta > 0.

The train rows carry the rollout's metrics under TRL's names (rewards/<function>/mean and /std, reward, reward_std,
frac_reward_zero_std, completions/*), the loss's (kl, clip_ratio/*) and the host's timings (time/rollout_s: the
rollout this step's batch came from, 0 on the steps that reuse it; time/update_s: the step itself, dispatch to
done). The eval rows, at step 0 (the starting point) and every train.eval_every steps, score greedy completions of
held-out prompts: `reward` and rewards/<function>/mean.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from systolic.data.tokenizer import Tokenizer, make_tokenizer, store_in_run, tokenizer_for_training
from systolic.engine import loop
from systolic.engine.checkpoint import has_checkpoints
from systolic.engine.run import Run
from systolic.engine.state import TrainState, param_count
from systolic.engine.step import CHECKED, jit_step, make_train_step
from systolic.errors import ConfigError
from systolic.optim.adamw import make_schedule
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import Rules, activate, logical_to_spec, rules_for
from systolic.workloads.lm import generate as generate_lib, init_from
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm import preflight
from systolic.workloads.lm.model import lora
from systolic.workloads.lm.optimizer import make_lm_optimizer
from systolic.workloads.lm.post.grpo_loss import grpo_loss, loss_weight
from systolic.workloads.lm.post.logps import token_logps
from systolic.workloads.lm.post.prompts import Prompt, load_prompts
from systolic.workloads.lm.post.rewards import Rewards
from systolic.workloads.lm.post.rollout import RolloutStream, Sampler, StreamParts, row_length
from systolic.workloads.lm.train import BuiltLMTask, make_state_fns, model_params, router_terms
from systolic.workloads.lm.model.build import model_graphdef

ROW_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "old_logps")  # (B, T) each


def train(cfg: LMConfig, run_dir: Path, quiet: bool = False) -> loop.RunResult:
    """`systolic train lm` with objective=grpo."""
    init_from.check_not_imported(run_dir)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    resuming = cfg.checkpoint.resume and has_checkpoints(run_dir)
    spec = tokenizer_for_training(run_dir, cfg.data.tokenizer, resuming=resuming)
    tokenizer = make_tokenizer(spec)
    # A finished GRPO run cannot roll out its next batch (RolloutStream.__next__): it goes on as a new run.
    run = Run.start(cfg, steps=cfg.train.steps, eval_every=cfg.train.eval_every, quiet=quiet,
                    further=f"start a new run from this one (init.from={run_dir}) with a new --run-dir")
    built = build_task(cfg, mesh, tokenizer, warn=run.say)
    if jax.process_index() == 0:
        store_in_run(run_dir, spec)
    g = cfg.grpo
    trained = ("all trained" if built.trainable_count == built.param_count
               else f"{built.trainable_count:,} trained (LoRA rank {cfg.model.lora.rank})")
    run.say(f"lm grpo: {built.param_count / 1e6:.2f}M parameters, {trained} ({cfg.model.family}, {cfg.model.layers} "
            f"layers) on mesh {mesh_lib.describe(mesh)} ({jax.device_count()} {jax.default_backend()} devices)")
    run.say(f"data: {built.corpus.describe()}; {g.group_size} completions of up to {g.max_completion_len} tokens per "
            f"prompt, {cfg.train.batch_size} a step, each rollout trained on {g.num_iterations}x; run directory "
            f"{run_dir}")
    row = built.task.data.parts.row_len - 1
    run.say(f"update rows of {row} tokens: the longest prompt and grpo.max_completion_len, rounded up to a power of "
            f"two" + (f" (data.seq_len={cfg.data.seq_len} caps them)" if row == cfg.data.seq_len else ""))
    with activate(mesh, built.rules):
        result = run.loop(built.task, run_dir)
    if run.stopped(result):
        return result
    if result.eval_metrics:
        run.say(f"held-out reward (greedy): {result.eval_metrics['reward']:.4f}")
    run.say_throughput(result, "completions/s", digits=1)
    if cfg.sample.max_new_tokens and jax.process_index() == 0 and not quiet:
        generate_lib.say_sample(run.say, tokenizer, built.graphdef, model_params(result.state), cfg.sample, chat=True)
    return result


def check(cfg: LMConfig) -> None:
    """What GRPO needs of the rest of the config, checked before anything is read (its data settings: LMConfig's
    _check_post_data, as DPO's)."""
    g = cfg.grpo
    if cfg.train.batch_size % g.group_size:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is not a multiple of grpo.group_size={g.group_size}: a step "
            "trains on whole groups of completions (batch_size / group_size prompts). Fix: e.g. "
            f"train.batch_size={max(1, cfg.train.batch_size // g.group_size) * g.group_size}.")
    if g.max_completion_len >= cfg.data.seq_len:
        # Under init.from the model, and so model.max_seq_len, is the source's: only data.seq_len can grow, up to it.
        room = cfg.model.max_seq_len > max(cfg.data.seq_len, g.max_completion_len)
        longer = (f"data.seq_len={cfg.model.max_seq_len} (the model's context), or " if room else
                  "" if cfg.init.from_ else "data.seq_len and model.max_seq_len higher, or ")
        raise ConfigError(
            f"grpo.max_completion_len={g.max_completion_len} leaves no room for a prompt in a row of data.seq_len="
            f"{cfg.data.seq_len} tokens (a row holds the prompt and its completion). Fix: {longer}"
            f"grpo.max_completion_len={cfg.data.seq_len // 2} (half the row for the prompt).")
    if cfg.mesh.context > 1 or cfg.mesh.stage > 1:
        raise ConfigError(
            f"objective=grpo with mesh.context={cfg.mesh.context}, mesh.stage={cfg.mesh.stage}: rollouts run on the "
            "serving engine, which splits neither sequences nor layers. Fix: mesh.context=1 mesh.stage=1 (shard with "
            "mesh.fsdp and mesh.tensor).")


# THE LOSS -----------------------------------------------------------------------------------------------------


def policy_logps(logits: jax.Array, targets: jax.Array, vocab_limit: int, temperature: float) -> jax.Array:
    """logits (B, T, V) float32 -> log p(targets) (B, T) float32 under the distribution the sampler draws from:
    softmax(logits / temperature) over the tokenizer's ids (the embedding's padding rows are never sampled)."""
    V = logits.shape[-1]
    limited = jnp.where(jnp.arange(V) < vocab_limit, logits, -jnp.inf)  # (B, T, V)
    return token_logps(limited, targets, temperature)


def _forward_logps(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array], vocab_limit: int,
                   temperature: float) -> tuple[jax.Array, Any]:
    """The batch's token log-probabilities (B, T) and the MoE layers' stats (None for a dense model)."""
    model = nnx.merge(graphdef, params)
    logits, stats = model.with_moe_stats(batch["inputs"], segment_ids=batch["segment_ids"],
                                         positions=batch["positions"])  # (B, T, V)
    return policy_logps(logits, batch["targets"], vocab_limit, temperature), stats  # (B, T)


def make_loss_fn(cfg: LMConfig, graphdef: nnx.GraphDef, vocab_limit: int):
    """The engine step's `loss_fn(params, batch, key, frozen=None) -> (loss, metrics)`: grpo_loss of the policy's
    log-probabilities of the batch's completions."""
    g = cfg.grpo

    def loss_fn(params: Any, batch: dict[str, jax.Array], key: jax.Array,
                frozen: dict[str, Any] | None = None) -> tuple[jax.Array, dict]:
        del key  # no dropout
        logps, stats = _forward_logps(graphdef, lora.combine(params, frozen or {}), batch, vocab_limit,
                                      g.temperature)
        loss, metrics = grpo_loss(logps, batch["old_logps"], batch.get("ref_logps"), batch["advantages"],
                                  batch["loss_mask"].astype(jnp.float32), clip_eps=g.clip_eps,
                                  clip_eps_high=g.clip_eps_high, beta=g.beta, loss=g.loss,
                                  max_completion_len=g.max_completion_len)
        if stats is None:
            return loss, metrics
        router, router_metrics = router_terms(cfg.model.moe, stats)  # the GRPO loss alone: moe/grpo
        return loss + router, {**metrics, **router_metrics, "moe/grpo": loss}

    return loss_fn


def make_ref_logps(cfg: LMConfig, vocab: int, vocab_limit: int, init_state):
    """(state, batch) -> the reference policy's log-probabilities (B, T) float32: init.from's weights, which with
    model.lora are the state's frozen base (no copy), else a copy made once from `init_state`."""
    graphdef = model_graphdef(lora.base_config(cfg.model), vocab)
    logps = jax.jit(lambda params, batch: _forward_logps(graphdef, params, batch, vocab_limit,
                                                         cfg.grpo.temperature)[0])
    kept: list[Any] = []

    def reference(state: TrainState) -> Any:
        if cfg.model.lora.rank:
            return state.frozen
        if not kept:
            kept.append(init_state().params)
        return kept[0]

    return lambda state, batch: logps(reference(state), batch)


# EVALUATION ---------------------------------------------------------------------------------------------------


def make_evaluate(cfg: LMConfig, prompts: tuple[Prompt, ...], sampler: Sampler, rewards: Rewards):
    """Greedy completions of held-out prompts (at most train.eval_batches x train.batch_size), scored: the mean
    reward (`reward`) and each function's (rewards/<name>/mean), and the mean completion length."""
    chosen = prompts[:cfg.train.eval_batches * cfg.train.batch_size]

    def evaluate(state: TrainState) -> dict[str, float]:
        completions = sampler.complete(model_params(state), chosen, seeds=None, temperature=0.0, top_k=0, top_p=1.0,
                                       max_tokens=cfg.grpo.max_completion_len)
        scores = rewards.score([p.text for p in chosen], completions.texts, [p.fields for p in chosen],
                               record_ids=[p.name for p in chosen])  # (N, F)
        out = {"reward": float(rewards.total(scores).mean())}
        out |= {f"rewards/{name}/mean": float(scores[:, j].mean()) for j, name in enumerate(rewards.names)}
        return out | {"completions/mean_length": completions.length_metrics()["completions/mean_length"]}

    return evaluate


# THE TASK -----------------------------------------------------------------------------------------------------


def batch_shardings(mesh: Mesh, rules: Rules, beta: float) -> dict[str, NamedSharding]:
    """Each batch array's layout: rows over the batch axes; `ref_logps` only with the KL term."""
    rows = NamedSharding(mesh, logical_to_spec(("batch", "seq"), rules))
    keys = ROW_KEYS + (("ref_logps",) if beta else ())
    return {**{k: rows for k in keys}, "advantages": NamedSharding(mesh, logical_to_spec(("batch",), rules))}


def make_place(shardings: dict[str, NamedSharding], global_rows: int):
    """A host batch (every process computes all of it) -> global arrays, each process giving its devices' rows."""
    lo, hi = mesh_lib.local_rows(shardings["inputs"], global_rows)

    def place(host: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_process_local_data(shardings[k], v[lo:hi], v.shape) for k, v in host.items()}

    return place


def build_task(cfg: LMConfig, mesh: Mesh, tokenizer: Tokenizer,
               warn: Callable[[str], None] = lambda message: None) -> BuiltLMTask:
    """The GRPO task of `cfg` on `mesh`: everything checkable (config, prompts, reward functions) is checked before
    anything compiles or is written. `warn` says the rollouts' warnings."""
    check(cfg)
    rules = rules_for(cfg.sharding.rules, mesh)
    mesh_lib.check_batch(cfg.train.batch_size, cfg.train.grad_accum, mesh)
    vocab = cfg.model.padded_vocab(tokenizer.vocab_size)
    preflight.check_training_fits(cfg, vocab, list(mesh.devices.flat))
    g = cfg.grpo
    prompts = load_prompts(cfg.data.path, tokenizer, max_prompt_len=cfg.data.seq_len - g.max_completion_len,
                           val_percent=cfg.data.val_percent)
    rewards = Rewards(cfg.reward)  # imports the user's functions: a bad name stops here
    schedule = make_schedule(cfg.optim, cfg.train.steps)  # lr(t): the optimizer's and the logged metric's
    tx = make_lm_optimizer(cfg.optim, cfg.model, schedule)
    init, abstract, shardings = make_state_fns(cfg, vocab, mesh, rules, tx)
    graphdef = model_graphdef(cfg.model, vocab)
    limit = tokenizer.vocab_size
    step_fn = make_train_step(make_loss_fn(cfg, graphdef, limit), tx, schedule,
                              cfg.train.grad_accum, loss_terms=lambda mb: loss_weight(mb["loss_mask"], g.loss))
    batch_shard = batch_shardings(mesh, rules, g.beta)
    train_step = jit_step(step_fn, state_shardings=shardings, batch_sharding=batch_shard, mesh=mesh, loop=cfg.loop,
                          check=CHECKED)
    # Rows fit the longest prompt, held-out ones included (the sampler serves both), not data.seq_len.
    row_len = row_length((*prompts.train, *prompts.val), g.max_completion_len, cfg.data.seq_len)
    sampler = Sampler(cfg.model, tokenizer, rows=cfg.train.batch_size, seq_len=row_len - 1, mesh=mesh, rules=rules)
    parts = StreamParts(prompts=prompts.train, sampler=sampler, rewards=rewards,
                        place=make_place(batch_shard, cfg.train.batch_size), policy_params=model_params,
                        ref_logps=make_ref_logps(cfg, vocab, limit, init) if g.beta else None,
                        pad_id=tokenizer.pad_id, row_len=row_len, warn=warn)
    stream = RolloutStream(cfg, parts)
    task = loop.Task(
        workload="lm", abstract_state=abstract, init_state=init, train_step=train_step, data=stream, check=CHECKED,
        evaluate=make_evaluate(cfg, prompts.val, sampler, rewards), evaluate_at_start=True,
        items_per_step=cfg.train.batch_size, item_unit="completions", meta={"workload": "lm", "vocab": vocab},
        progress_keys=("loss", "reward", "frac_reward_zero_std"), step_metrics=stream.step_metrics,
        memory_advice=preflight.MEMORY_FIX, first_step_note=stream.first_step_note,
    )
    task.add_hook(stream.after_step, every=1)
    trainable = param_count(abstract.params)
    return BuiltLMTask(task=task, mesh=mesh, rules=rules, corpus=prompts, vocab=vocab, graphdef=graphdef,
                       param_count=trainable + param_count(abstract.frozen), trainable_count=trainable)

