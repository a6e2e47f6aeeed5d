"""The settings of the lm's post-training objectives: the `dpo`, `grpo` and `reward` sections. Each exists only in a
config whose `objective` uses it (lm/config.py fills in the chosen one's defaults and refuses the others)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

from systolic.config import check_positive
from systolic.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """Direct preference optimisation (Rafailov et al. 2023) with TRL's `DPOTrainer` losses under TRL's names: the
    policy's log-probability ratio to the frozen reference (`init.from`; with model.lora its base without adapters)
    on the chosen completion against the rejected one."""

    loss: Literal["sigmoid", "ipo", "robust"] = "sigmoid"  # TRL's loss_type
    beta: float = 0.1  # TRL's beta: the strength of the pull towards the reference (the KL weight)
    label_smoothing: float = 0.0  # robust: the assumed share of flipped preference labels (TRL's label_smoothing)
    # cached: the reference's log-probabilities of every pair computed once before training (no reference forward
    # pass per step); live: computed in every step from the frozen reference weights.
    reference: Literal["cached", "live"] = "cached"

    def validate(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"dpo.beta={self.beta} must be greater than 0: it scales the log-probability ratios "
                              "(TRL's default is 0.1). Fix: e.g. dpo.beta=0.1.")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                f"dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5): it is the share of preference "
                "labels assumed flipped, and at 0.5 the robust loss divides by zero. Fix: e.g. dpo.label_smoothing=0.1"
                + ("." if self.loss == "robust" else " dpo.loss=robust (only the robust loss reads it), or 0."))
        if self.label_smoothing and self.loss != "robust":
            raise ConfigError(
                f"dpo.label_smoothing={self.label_smoothing} with dpo.loss={self.loss}: only the robust loss reads it. "
                "Fix: dpo.loss=robust, or drop dpo.label_smoothing.")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Group relative policy optimisation (Shao et al. 2024, DeepSeekMath) under TRL's `GRPOTrainer` names: for each
    prompt `group_size` completions are sampled by the serving engine with the policy's current weights, scored by
    the `reward` section's functions, and each completion's advantage is its reward relative to its group's. A step
    trains on train.batch_size completions (train.batch_size / group_size prompts)."""

    group_size: int = 8  # G, TRL's num_generations
    max_completion_len: int = 64  # TRL's max_completion_length, in tokens
    temperature: float = 1.0  # the sampler's; the policy's log-probabilities are of the same tempered distribution
    top_p: float = 1.0
    top_k: int = 0
    clip_eps: float = 0.2  # TRL's epsilon: the importance ratio clipped to [1 - clip_eps, 1 + clip_eps_high]
    clip_eps_high: float = 0.0  # 0: clip_eps (DAPO's clip-higher sets e.g. 0.28); TRL's epsilon_high
    beta: float = 0.0  # the KL penalty's weight (the k3 estimator against the reference, init.from); 0: none
    num_iterations: int = 1  # optimizer steps on each batch of rollouts (TRL's num_iterations, mu)
    # How token losses make the step's loss: grpo = mean over each completion's tokens, then over completions (the
    # paper); dr_grpo = sum over tokens / (completions * max_completion_len) (Dr. GRPO, no length bias); dapo = sum
    # over all tokens / their number (DAPO's token-level loss). TRL's loss_type.
    loss: Literal["grpo", "dr_grpo", "dapo"] = "dapo"
    # group: (reward - group mean) / group std (GRPO); none: reward - group mean (Dr. GRPO); TRL's scale_rewards.
    scale_rewards: Literal["group", "none"] = "group"

    def validate(self) -> None:
        check_positive(self, "grpo", ("group_size", "max_completion_len", "num_iterations"))
        if self.group_size < 2:
            raise ConfigError(
                f"grpo.group_size={self.group_size}: advantages compare each completion with the others of its group, "
                "so a group needs at least 2. Fix: e.g. grpo.group_size=8.")
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and self.top_k >= 0):
            raise ConfigError(
                f"grpo.temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k} out of range: rollouts "
                "sample (temperature > 0; greedy groups would be identical), 0 < top_p <= 1, top_k >= 0 (0: off). "
                "Fix: e.g. grpo.temperature=1.0 grpo.top_p=1.0 grpo.top_k=0.")
        if not (0 < self.clip_eps < 1 and self.clip_eps_high >= 0 and self.beta >= 0):
            raise ConfigError(
                f"grpo.clip_eps={self.clip_eps}, clip_eps_high={self.clip_eps_high}, beta={self.beta} out of range: "
                "0 < clip_eps < 1, clip_eps_high >= 0 (0: clip_eps), beta >= 0 (0: no KL penalty). Fix: e.g. "
                "grpo.clip_eps=0.2 grpo.beta=0.04.")


MAX_TIMEOUT_S = 86400.0
BUILT_IN_REWARDS = ("number_match", "exact_match", "format")  # post/rewards.py's verifiers
USER_REWARD = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")  # module.path:function


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The rewards of GRPO's completions: built-in verifiers or a user's functions, summed with weights."""

    # comma-separated: built-ins (number_match, exact_match, format) or module:function, a function
    # (prompt: str, completion: str, fields: dict) -> float importable from the working directory
    functions: str = "number_match"
    weights: str = ""  # comma-separated floats, one per function; empty: 1 each
    answer_field: str = "answer"  # number_match / exact_match: the prompt record's field holding the answer
    format_pattern: str = ""  # format: a regular expression the completion must match (re.search) for reward 1
    # module:function rewards run in a worker process (post/reward_worker.py); a call past this many seconds stops
    # the run (exit 2) instead of stalling it
    timeout_s: float = 30.0

    @property
    def function_specs(self) -> tuple[str, ...]:
        return tuple(spec.strip() for spec in self.functions.split(",") if spec.strip())

    @property
    def names(self) -> tuple[str, ...]:
        """The functions' names in the metrics (rewards/<name>/mean): a built-in's own, a user function's name after
        the colon (TRL names reward functions by their __name__)."""
        return tuple(spec.rpartition(":")[2] for spec in self.function_specs)

    @property
    def weight_values(self) -> tuple[float, ...]:
        """One weight per function (1 each when reward.weights is empty); validate() checks they parse."""
        if not self.weights.strip():
            return (1.0,) * len(self.function_specs)
        return tuple(float(w) for w in self.weights.split(","))

    def validate(self) -> None:
        """The functions' names and weights, the pattern and the answer field; user modules are imported when the
        run builds its rewards (post/rewards.py), not here: a finished run's config must load where they are not."""
        specs = self.function_specs
        fix = "Fix: e.g. reward.functions=number_match,format, or reward.functions=my_rewards:score."
        if not specs:
            raise ConfigError(f"reward.functions is empty: GRPO needs at least one reward. Expected built-ins "
                              f"({', '.join(BUILT_IN_REWARDS)}) or module:function, comma-separated. {fix}")
        for spec in specs:
            if spec not in BUILT_IN_REWARDS and not USER_REWARD.fullmatch(spec):
                raise ConfigError(f"reward.functions has '{spec}', which is neither a built-in "
                                  f"({', '.join(BUILT_IN_REWARDS)}) nor module:function (a Python module path, a "
                                  f"colon, a function name). {fix}")
        names = self.names
        if len(set(names)) != len(names):
            raise ConfigError(f"reward.functions={self.functions} names a function twice (by its name: "
                              f"{', '.join(names)}), so their metrics rewards/<name>/* would collide. Fix: list each "
                              "function once (weigh one more with reward.weights), or rename one of them.")
        self._check_weights(len(specs))
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ConfigError(f"reward.timeout_s={self.timeout_s:g} is out of range: a reward function's time limit "
                              f"per call is more than 0 and at most {MAX_TIMEOUT_S:g} seconds (a day). Fix: e.g. "
                              "reward.timeout_s=30.")
        self._check_format("format" in specs)
        if {"number_match", "exact_match"} & set(specs) and not self.answer_field:
            raise ConfigError("reward.answer_field is empty, but number_match and exact_match compare the completion "
                              "with the prompt record's answer field. Fix: e.g. reward.answer_field=answer.")

    def _check_weights(self, count: int) -> None:
        try:
            weights = self.weight_values
        except ValueError:
            weights = None
        if weights is None or len(weights) != count or not all(math.isfinite(w) for w in weights):
            raise ConfigError(f"reward.weights={self.weights!r} must be {count} finite numbers, comma-separated, one "
                              f"per function of reward.functions={self.functions} (or empty: 1 each). Fix: e.g. "
                              f"reward.weights={','.join(['1.0'] * count)}.")

    def _check_format(self, listed: bool) -> None:
        if listed and not self.format_pattern:
            raise ConfigError("reward.functions has format, but reward.format_pattern is empty: the format reward is 1 "
                              "when the completion matches that regular expression (re.search). Fix: e.g. "
                              "reward.format_pattern='####\\s*-?[0-9]'.")
        if self.format_pattern and not listed:
            raise ConfigError(f"reward.format_pattern={self.format_pattern!r} is set, but reward.functions="
                              f"{self.functions} has no format reward, so it would do nothing. Fix: add format to "
                              "reward.functions, or drop reward.format_pattern.")
        try:
            re.compile(self.format_pattern)
        except re.error as e:
            raise ConfigError(f"reward.format_pattern={self.format_pattern!r} is not a valid regular expression ({e}). "
                              "Fix: correct it (Python's re syntax), e.g. reward.format_pattern='<answer>.*</answer>'."
                              ) from e
