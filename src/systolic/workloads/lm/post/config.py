"""The settings of the lm's post-training objectives: the `dpo`, `grpo` and `reward` sections. Each exists only in a
config whose `objective` uses it (lm/config.py fills in the chosen one's defaults and refuses the others)."""

from __future__ import annotations

import dataclasses
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
                "labels assumed flipped, and at 0.5 the robust loss divides by zero. Fix: e.g. dpo.label_smoothing=0.1.")
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


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The rewards of GRPO's completions: built-in verifiers or a user's functions, summed with weights."""

    # comma-separated: built-ins (number_match, exact_match, format) or module:function, a function
    # (prompt: str, completion: str, fields: dict) -> float importable from the working directory
    functions: str = "number_match"
    weights: str = ""  # comma-separated floats, one per function; empty: 1 each
    answer_field: str = "answer"  # number_match / exact_match: the prompt record's field holding the answer
    format_pattern: str = ""  # format: a regular expression the completion must match (re.search) for reward 1
