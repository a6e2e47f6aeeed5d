"""GRPO's rollouts: completions sampled by the serving engine (lm/serve/engine.py) in the training process, with the
policy's current weights, and the train batches made of them.

`Sampler` keeps one engine on the training mesh and rules, so the trainer's parameters are served where they lie
(no copy, nothing through disk); before each rollout it takes the new weights and drops its prefix cache. It asks
for the log-probabilities of the distribution it samples from, softmax(logits / temperature) without top-k/top-p
(TRL's convention), which are what the policy's forward pass computes at grpo.temperature (post/logps.py): on the
first update of a batch the importance ratio is 1 up to float rounding.

`RolloutStream` is the task's data: the rollout of step s + 1 is made by a loop hook right after step s (and on the
initial state as step 0), while the state is still the loop's, before the next step donates its buffers. The batch
then serves grpo.num_iterations steps. Its host arrays and the stream's position are the stream's checkpoint state,
so a run resumed between (or within) those steps trains on the same batch. Sampling seeds derive from train.seed,
the rollout's index and the completion's, so a resumed run samples what an uninterrupted one would.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from systolic.data import packed
from systolic.engine.state import TrainState
from systolic.errors import UserError
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.post.grpo_loss import group_advantages
from systolic.workloads.lm.post.prompts import Prompt
from systolic.workloads.lm.post.rewards import Rewards
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams

PAGE_SIZE = 16  # tokens per page of the rollout engine's KV cache
MIN_TOKENS_PER_STEP = 256  # the engine's largest step, in tokens (at least one per sequence)
# The share of groups with one reward for all their completions above which ("most") a rollout warns: their
# advantages are 0, so most of the batch teaches nothing.
MOSTLY_ZERO_STD = 0.5


def row_length(prompts: Sequence[Prompt], max_completion_len: int, seq_len: int) -> int:
    """The tokens of one update row (+ 1 for the shifted target): the longest prompt and grpo.max_completion_len,
    rounded up to a power of two and capped at data.seq_len. A row of data.seq_len for 10-token prompts and 60-token
    completions costs the step up to data.seq_len / 70 times the work; the power of two keeps the compiled shapes
    few and tile-friendly."""
    needed = max(len(p.ids) for p in prompts) + max_completion_len
    return min(seq_len, 1 << (needed - 1).bit_length()) + 1


# SAMPLING ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Completions:
    """What the policy wrote after N prompts."""

    ids: tuple[np.ndarray, ...]  # each (C_i,) int32: the sampled tokens, the stop id included when one ended it
    logps: tuple[np.ndarray, ...]  # each (C_i,) float32: their log-probabilities under the tempered softmax
    texts: tuple[str, ...]  # decoded, without the stop id: what the rewards read
    truncated: np.ndarray  # (N,) bool: cut at grpo.max_completion_len, no stop id

    def identical_groups(self, group_size: int) -> int:
        """How many of the consecutive groups of `group_size` completions have all their tokens the same."""
        groups = [self.ids[i:i + group_size] for i in range(0, len(self.ids), group_size)]
        return sum(all(np.array_equal(ids, group[0]) for ids in group[1:]) for group in groups)

    def length_metrics(self) -> dict[str, float]:
        """TRL's completion-length metrics (in tokens, the stop id counted) and the share cut at the limit."""
        lengths = np.array([len(ids) for ids in self.ids], np.float32)  # (N,)
        return {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()),
                "completions/clipped_ratio": float(self.truncated.mean())}


class Sampler:
    """The serving engine sized for `rows` sequences of at most `seq_len` tokens, on the training `mesh` and `rules`
    (None: one device). Built on the first call, from the weights it is given."""

    def __init__(self, model: ModelConfig, tokenizer: Any, *, rows: int, seq_len: int,
                 mesh: jax.sharding.Mesh | None, rules: Any):
        self.model, self.tokenizer, self.rows, self.seq_len = model, tokenizer, rows, seq_len
        self.mesh, self.rules = mesh, rules
        self.engine: InferenceEngine | None = None

    def complete(self, params: Any, prompts: Sequence[Prompt], *, seeds: Sequence[int] | None, temperature: float,
                 top_k: int, top_p: float, max_tokens: int) -> Completions:
        """Completion i continues prompts[i], sampled with seeds[i] (seeds None: greedy, temperature ignored)."""
        self._serve(params)
        engine = self.engine
        for i, prompt in enumerate(prompts):
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0 if seeds is None else temperature,
                                      top_k=top_k, top_p=top_p, seed=None if seeds is None else int(seeds[i]),
                                      logprobs=True, stop_token_ids=prompt.stop_ids, tempered_logprobs=True)
            engine.add_request(str(i), prompt.ids.tolist(), sampling)
        ids: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        texts = [""] * len(prompts)
        truncated = np.zeros(len(prompts), bool)
        while engine.has_work():
            for event in engine.step():
                i = int(event.request_id)
                ids[i].append(event.token_id)
                logps[i].append(event.logprob)
                texts[i] += event.text
                truncated[i] = event.finish_reason == "length"
        return Completions(tuple(np.asarray(x, np.int32) for x in ids), tuple(np.asarray(x, np.float32) for x in logps),
                           tuple(texts), truncated)

    def _serve(self, params: Any) -> None:
        if self.engine is not None:
            self.engine.set_params(params)
            return
        pages = self.rows * -(-self.seq_len // PAGE_SIZE) + 1  # every sequence at its longest at once, + the null page
        self.engine = InferenceEngine(self.model, params, self.tokenizer, kv_pages=pages, page_size=PAGE_SIZE,
                                      max_seqs=self.rows, max_tokens_per_step=max(self.rows, MIN_TOKENS_PER_STEP),
                                      mesh=self.mesh, rules=self.rules)


def completion_seed(train_seed: int, rollout: int, index: int) -> int:
    """The sampling seed of completion `index` of rollout `rollout`: fixed by the run's seed alone, so a resumed run
    samples what an uninterrupted one would."""
    return int(np.random.SeedSequence([train_seed, rollout, index]).generate_state(1, np.uint32)[0])


# THE BATCH --------------------------------------------------------------------------------------------------


def make_batch(prompts: Sequence[Prompt], completions: Completions, advantages: np.ndarray, *, row_len: int,
               pad_id: int) -> dict[str, np.ndarray]:
    """One row of `row_len` tokens per completion, its prompt before it: packed.BATCH_KEYS (B, row_len - 1) int32
    (`loss_mask`: 1 where the target is a completion token), `old_logps` (B, row_len - 1) float32 (the sampler's
    log-probability of each such target, 0 elsewhere) and `advantages` (B,) float32."""
    B = len(prompts)
    tokens = np.full((B, row_len), pad_id, np.int32)
    flags = np.zeros((B, row_len), np.uint8)
    old_logps = np.zeros((B, row_len - 1), np.float32)
    for i, (prompt, ids, logps) in enumerate(zip(prompts, completions.ids, completions.logps, strict=True)):
        P, C = len(prompt.ids), len(ids)
        assert P + C <= row_len - 1, (P, C, row_len)  # the prompt's limit leaves room for max_completion_len
        tokens[i, :P], tokens[i, P:P + C] = prompt.ids, ids
        flags[i, P:P + C] = packed.LEARN
        flags[i, 0] = flags[i, P + C] = packed.START  # the sequence, then the padding after it: segments of their own
        old_logps[i, P - 1:P - 1 + C] = logps  # input P - 1 + k predicts completion token k
    return {**packed.as_batch(tokens, flags), "old_logps": old_logps, "advantages": advantages.astype(np.float32)}


# THE STREAM -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StreamParts:
    """What `RolloutStream` works with, besides the config."""

    prompts: tuple[Prompt, ...]  # the training prompts
    sampler: Sampler
    rewards: Rewards
    place: Callable[[dict[str, np.ndarray]], dict[str, jax.Array]]  # a host batch -> global arrays on the mesh
    policy_params: Callable[[TrainState], Any]  # the whole model's parameters of a state
    # (state, placed batch) -> the reference policy's log-probabilities (B, T) float32; None without the KL term
    ref_logps: Callable[[TrainState, dict[str, jax.Array]], jax.Array] | None
    pad_id: int
    row_len: int  # tokens of an update row, + 1 (row_length)
    warn: Callable[[str], None]  # says a warning (the run's printer)


class RolloutStream:
    """The GRPO task's data stream (engine/loop.py's DataStream) and its loop hook `after_step`."""

    def __init__(self, cfg: LMConfig, parts: StreamParts):
        self.cfg, self.parts = cfg, parts
        self.group = cfg.grpo.group_size
        self.position = 0  # prompts taken so far
        self.rollouts = 0  # rollouts made so far
        self.served = 0  # steps that trained on the current batch
        self.host: dict[str, np.ndarray] | None = None  # the current batch
        self.device: dict[str, jax.Array] | None = None
        self.metrics: dict[str, float] = {}  # the current batch's rollout metrics
        # By step: the metrics of the batch it trained on and its timings, until the loop writes its row (after the
        # hook that may have rolled out the next batch).
        self._rows: dict[int, dict[str, float]] = {}
        self._rollout_s = 0.0
        self._dispatched = 0.0
        self.first_rollout_s: float | None = None  # this invocation's first rollout, for the first-step line
        self._warned = False

    # THE LOOP'S SIDE

    def __iter__(self) -> RolloutStream:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self.host is None or self.served == self.cfg.grpo.num_iterations:
            raise UserError(
                f"This GRPO run's checkpoint has no rollouts left for step {self._step() + 1}: it finished its "
                "train.steps, and the next rollout needs the weights the last step made, which only a running "
                "run has. Fix: start a new run from this one (init.from=this run directory) to train further."
            )
        self.served += 1
        self._rows[self._step()] = {**self.metrics, "time/rollout_s": self._rollout_s if self.served == 1 else 0.0}
        self._dispatched = time.perf_counter()
        return self.device

    def after_step(self, step: int, state: TrainState) -> None:
        """The loop's hook: times step `step` and, once its batch is used up, rolls out the next (unless this was
        the run's last step)."""
        if step > 0:
            jax.block_until_ready(state.params)  # the step's update is done: its wall time ends here
            self._rows[step]["time/update_s"] = time.perf_counter() - self._dispatched
        used_up = self.host is None or self.served == self.cfg.grpo.num_iterations
        if used_up and step < self.cfg.train.steps:
            self._roll_out(state)

    def first_step_note(self) -> str | None:
        """The first-step line's note (loop.Task.first_step_note): the rollout the first step trained on, when this
        invocation made it (a fresh run's step 0)."""
        if self.first_rollout_s is None:
            return None
        return (f"the rollout it trained on took {self.first_rollout_s:.1f} s before it (sampling with the serving "
                "engine, compiled on first use, and scoring)")

    def step_metrics(self, step: int) -> dict[str, float]:
        """Step `step`'s rollout metrics (of the batch it trained on) and timings, written with its train row."""
        return self._rows.pop(step)

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position, "rollouts": self.rollouts, "served": self.served,
                "metrics": self.metrics, "rollout_s": self._rollout_s,
                "batch": None if self.host is None else {k: _encode(v) for k, v in self.host.items()}}

    def set_state(self, state: dict[str, Any]) -> None:
        self.position, self.rollouts, self.served = state["position"], state["rollouts"], state["served"]
        self.metrics, self._rollout_s = dict(state["metrics"]), state["rollout_s"]
        self.host = None if state["batch"] is None else {k: _decode(v) for k, v in state["batch"].items()}
        self.device = None if self.host is None else self.parts.place(self.host)

    # ROLLING OUT

    def _step(self) -> int:
        """The step the current batch's latest use trained (its first is (rollouts - 1) * num_iterations + 1)."""
        return (self.rollouts - 1) * self.cfg.grpo.num_iterations + self.served

    def _roll_out(self, state: TrainState) -> None:
        """Samples group_size completions for each of the next prompts with `state`'s weights, scores them and
        makes the batch of the next num_iterations steps."""
        start = time.perf_counter()
        cfg, parts, G = self.cfg, self.parts, self.group
        prompts = [p for p in self._next_prompts(cfg.train.batch_size // G) for _ in range(G)]  # (B,) in groups
        seeds = [completion_seed(cfg.train.seed, self.rollouts, j) for j in range(len(prompts))]
        g = cfg.grpo
        completions = parts.sampler.complete(parts.policy_params(state), prompts, seeds=seeds,
                                             temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                                             max_tokens=g.max_completion_len)
        scores = parts.rewards.score([p.text for p in prompts], completions.texts, [p.fields for p in prompts],
                                     record_ids=[p.name for p in prompts])  # (B, F)
        totals = parts.rewards.total(scores)  # (B,)
        advantages = np.asarray(group_advantages(jnp.asarray(totals), G, g.scale_rewards))
        parts.rewards.check_groups(totals, advantages, G, [p.name for p in prompts])
        host = make_batch(prompts, completions, advantages, row_len=parts.row_len, pad_id=parts.pad_id)
        device = parts.place(host)
        if parts.ref_logps is not None:
            device["ref_logps"] = parts.ref_logps(state, device)
            host["ref_logps"] = np.asarray(jax.device_get(device["ref_logps"]))
        self.host, self.device, self.served = host, device, 0
        self.rollouts += 1
        self.metrics = {**parts.rewards.metrics(scores, G), **completions.length_metrics()}
        self._rollout_s = time.perf_counter() - start
        if self.first_rollout_s is None:
            self.first_rollout_s = self._rollout_s
        warning = zero_std_warning(cfg, self.metrics["frac_reward_zero_std"], completions.identical_groups(G),
                                   len(prompts) // G, step=self._step() + 1)
        if warning and not self._warned:  # once: the progress line carries frac_reward_zero_std from here on
            parts.warn(warning)
            self._warned = True

    def _next_prompts(self, n: int) -> list[Prompt]:
        """The next `n` training prompts: every prompt once per epoch, in an order shuffled by train.seed and the
        epoch."""
        prompts, count = self.parts.prompts, len(self.parts.prompts)
        epochs = range(self.position // count, (self.position + n - 1) // count + 1)
        order = np.concatenate([np.random.default_rng([self.cfg.train.seed, e]).permutation(count) for e in epochs])
        start = self.position - epochs[0] * count
        self.position += n
        return [prompts[i] for i in order[start:start + n]]


def zero_std_warning(cfg: LMConfig, frac_zero_std: float, identical: int, groups: int, *, step: int) -> str | None:
    """The warning for a rollout in which most groups' completions all earned one reward (None otherwise): with a
    group's advantages all 0 it teaches nothing, and a run of such rollouts trains for nothing."""
    if frac_zero_std <= MOSTLY_ZERO_STD:
        return None
    g, r = cfg.grpo, cfg.reward
    same = (f", {identical} of them with {g.group_size} identical completions" if identical else "")
    return (f"warning: in the rollout for step {step}, {frac_zero_std:.0%} of the {groups} groups earned one reward "
            f"for all their completions{same} (frac_reward_zero_std {frac_zero_std:.2f}): their advantages are 0, so "
            "they teach nothing, and a run of such rollouts will not move the reward. The progress line shows "
            "frac_reward_zero_std from here on. Fix: more varied completions (raise grpo.temperature, now "
            f"{g.temperature:g}, or grpo.group_size, now {g.group_size}), or rewards that tell near misses apart "
            f"(reward shaping: e.g. reward.functions={r.functions},format with reward.format_pattern, or your own "
            "module:function with partial credit).")


def _encode(x: np.ndarray) -> dict[str, Any]:
    """An array as JSON (the checkpoint's data state): exact, as its bytes in base64."""
    x = np.ascontiguousarray(x)
    return {"dtype": x.dtype.str, "shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode("ascii")}


def _decode(d: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["data"]), np.dtype(d["dtype"])).reshape(d["shape"]).copy()
