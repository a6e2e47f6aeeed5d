"""The `lm` workload's config: data, sampling and objective sections, the post-training objectives' sections (`dpo`,
`grpo`, `reward`: each exists only in a config whose `objective` uses it), plus the engine's common sections; the
model and pipeline sections are lm/model/config.py's."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

from systolic.config import (CheckpointConfig, LoopConfig, MeshConfig, ObserveConfig, OptimConfig, ShardingConfig,
                             TrainConfig, check_positive, check_seed)
from systolic.data.corpus import DEFAULT_VAL_PERCENT
from systolic.data.unicode_text import unicode_problem
from systolic.errors import ConfigError
from systolic.workloads.lm.model.config import ModelConfig, PipelineConfig


BFLOAT16_MAX_DECAY = 1 - 2**-8  # above it, round(b * m) == m for some bfloat16 m (for every m above 1 - 2^-9)


@dataclasses.dataclass(frozen=True)
class LMOptimConfig(OptimConfig):
    """The engine's AdamW settings plus what only the lm uses: Muon for the blocks' weight matrices, and the
    output-logit z-loss. With `name: muon` the blocks' projections (attention q, k, v, o and the MLP's) take Muon
    steps (optim/muon.py) at a peak rate `muon_lr`, on the same warmup and cosine schedule; the embeddings, the
    output layer, norms and biases keep AdamW at `lr`. Weight decay shrinks every matrix by lr * weight_decay a step,
    AdamW's rate, whichever optimizer moves it (lm/optimizer.py). `moment_dtype` is how the optimizer's moments (AdamW's
    two, Muon's momentum) are kept between steps; their arithmetic is float32 either way (docs/optimizers.md)."""

    name: Literal["adamw", "muon"] = "adamw"
    # bfloat16 halves the moments' memory (AdamW: 8 -> 4 bytes a parameter), rounding them to 8 significant bits a step
    moment_dtype: Literal["float32", "bfloat16"] = "float32"
    muon_lr: float = 0.02  # Keller Jordan's Muon default
    muon_momentum: float = 0.95  # Nesterov momentum of the Muon matrices
    z_loss: float = 0.0  # weight on the mean log(Z)^2 of the output softmax (PaLM uses 1e-4); 0 = off

    def validate(self) -> None:
        super().validate()
        if self.z_loss < 0:
            raise ConfigError(f"optim.z_loss={self.z_loss} must be >= 0: it weighs a penalty added to the loss (0 = "
                              "off). Fix: e.g. optim.z_loss=1e-4, PaLM's weight.")
        if not self.muon_lr > 0 or not 0 <= self.muon_momentum < 1:
            raise ConfigError(
                f"optim.muon_lr={self.muon_lr} and optim.muon_momentum={self.muon_momentum} out of range: the rate "
                "must be greater than 0 and the momentum in [0, 1). Fix: e.g. optim.muon_lr=0.02 "
                "optim.muon_momentum=0.95 (Keller Jordan's defaults)."
            )
        self._check_bfloat16_decays()

    def _check_bfloat16_decays(self) -> None:
        """A bfloat16 moment keeps 8 significant bits: times a decay above 1 - 2^-8, some moments round back to
        themselves (every one, above 1 - 2^-9, e.g. b2=0.999), so they would stop forgetting old gradients."""
        decays = {"b1": self.b1, "b2": self.b2}
        if self.name == "muon":
            decays["muon_momentum"] = self.muon_momentum
        slow = {k: v for k, v in decays.items() if v > BFLOAT16_MAX_DECAY}
        if self.moment_dtype == "bfloat16" and slow:
            raise ConfigError(
                f"optim.moment_dtype=bfloat16 with {', '.join(f'optim.{k}={v}' for k, v in slow.items())}: a bfloat16 "
                f"moment times a decay above {BFLOAT16_MAX_DECAY:.4f} (1 - 2^-8) can round back to itself (it keeps 8 "
                "significant bits), so it would stop forgetting old gradients. Fix: keep the moments in float32 "
                f"(optim.moment_dtype=float32), or use decays of at most {BFLOAT16_MAX_DECAY:.4f}, e.g. optim.b2=0.95."
            )


@dataclasses.dataclass(frozen=True)
class LMTrainConfig(TrainConfig):
    """The `train` section: the engine's run length and batch, plus gradient accumulation and the validation size."""

    grad_accum: int = 1  # micro-batches per optimizer step (each batch_size / grad_accum rows)
    eval_batches: int = 8  # validation batches of batch_size / grad_accum rows per evaluation

    def validate(self) -> None:
        super().validate()
        if self.grad_accum <= 0 or self.eval_batches <= 0:
            raise ConfigError(f"train.grad_accum={self.grad_accum} and train.eval_batches={self.eval_batches} must be "
                              "greater than 0. Fix: e.g. train.grad_accum=1 train.eval_batches=8.")
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"train.batch_size={self.batch_size} is not divisible by train.grad_accum={self.grad_accum}; "
                "each accumulation micro-step takes an equal slice of the batch. Fix: choose a batch size that "
                f"is a multiple of {self.grad_accum}, e.g. train.batch_size={self.grad_accum * max(1, self.batch_size // self.grad_accum)}."
            )


MAX_MIXTURE_RATIO = 1e6  # data.mixture: the largest weight over the smallest


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Text (or, with `format: chat`, chat records) to train on. An empty `path` means the Python standard library's
    own `.py` files."""

    # a text file, a directory of text files, a .jsonl (field `text`) or .parquet (column `text`); chat: .jsonl records
    path: str = ""
    seq_len: int = 256
    val_percent: float = DEFAULT_VAL_PERCENT  # share of documents held out for validation, chosen by a hash of their name
    max_bytes: int = 0  # 0: use the whole corpus; else stop reading after this many bytes
    # "byte", or a Hugging Face tokenizer.json (or a folder holding one). The file is checked when it is loaded,
    # not here: a finished run's config names the original path, and a run reads its own copy RUN_DIR/tokenizer.json.
    tokenizer: str = "byte"
    # "DIR:WEIGHT,DIR:WEIGHT": prepared datasets (`systolic data prepare`) sampled by weight, instead of data.path
    mixture: str = ""
    # How documents share a window of seq_len tokens (docs/data.md, "Document packing"): "concat" attends across
    # the end-of-document tokens as if the corpus were one text; "documents" masks attention to each document and
    # restarts positions at each document, the end-of-document token opening the next one.
    packing: Literal["concat", "documents"] = "concat"
    # "text": documents to continue. "chat": supervised fine-tuning records (`messages`, or `prompt`/`completion`)
    # from .jsonl, packed whole into rows, with the loss on the assistant's tokens only (data/sft.py).
    format: Literal["text", "chat"] = "text"

    @property
    def mixture_sources(self) -> list[tuple[str, float]]:
        """data.mixture as (prepared folder, weight) pairs; empty when unset. ConfigError when malformed."""
        sources = []
        for item in filter(None, (part.strip() for part in self.mixture.split(","))):
            path, _, weight = item.rpartition(":")
            try:
                value = float(weight)
            except ValueError:
                value = math.nan
            if not path or not math.isfinite(value) or value <= 0:
                raise ConfigError(
                    f"data.mixture={self.mixture!r}: {item!r} is not DIR:WEIGHT with a positive weight. Expected "
                    "comma-separated prepared folders with weights, e.g. data.mixture='data/web:0.7,data/code:0.3'. "
                    "Fix: give every folder a weight greater than 0."
                )
            sources.append((path, value))
        weights = [w for _, w in sources]
        # Grain's mix scales the weights to integers, the smallest to 100 (`text.mixture_counts`): that scale and
        # the sum must be finite, and a source that gets under one row in a million is noise in any run.
        if sources and (not math.isfinite(sum(weights)) or not math.isfinite(100 / min(weights))
                        or max(weights) / min(weights) > MAX_MIXTURE_RATIO):
            raise ConfigError(
                f"data.mixture={self.mixture!r}: the weights range from {min(weights):g} to {max(weights):g}. Expected "
                f"weights whose sum is a finite number and whose largest is at most {MAX_MIXTURE_RATIO:g} times the "
                "smallest (they are proportions: only their ratios count). Fix: rescale them, e.g. "
                "data.mixture='data/web:0.7,data/code:0.3', and drop a source that should get almost no rows."
            )
        return sources

    def validate(self) -> None:
        if self.mixture_sources and self.path:
            raise ConfigError(
                f"data.mixture={self.mixture!r} and data.path={self.path!r} are both set; a run reads one or the other. "
                "Fix: drop data.path, or data.mixture."
            )
        check_positive(self, "data", ("seq_len",))
        if not 0 < self.val_percent < 100:
            raise ConfigError(f"data.val_percent={self.val_percent} must be between 0 and 100 (exclusive). Fix: e.g. data.val_percent=5.")
        if self.max_bytes < 0:
            raise ConfigError(f"data.max_bytes={self.max_bytes} must be >= 0 (0 means no limit).")
        if self.format == "chat":
            self._check_chat()
        if not self.tokenizer.strip():
            raise ConfigError(
                "data.tokenizer is empty. Expected 'byte' (the built-in byte-level tokenizer) or the path of a Hugging "
                "Face tokenizer.json. Fix: set data.tokenizer=byte, or data.tokenizer=tok.json after "
                "`systolic tokenizer train --vocab-size 8192 --out tok.json`."
            )

    def _check_chat(self) -> None:
        if self.packing != "documents":
            raise ConfigError(
                f"data.format=chat with data.packing={self.packing}: chat examples are packed whole into rows, and "
                "with concat packing they would attend to each other. Expected data.packing=documents, which keeps "
                "attention within each example and restarts positions there. Fix: add data.packing=documents (the "
                "sft recipe sets it: `systolic train lm --recipe sft`)."
            )
        ignored = {key: value for key, value in (("data.mixture", self.mixture), ("data.max_bytes", self.max_bytes))
                   if value}
        if not self.path or ignored:
            got = ", ".join(f"{k}={v!r}" for k, v in ignored.items()) or "data.path=''"
            raise ConfigError(
                f"data.format=chat reads chat records from data.path, but got {got}. Expected data.path naming a .jsonl "
                "file (or a folder of them) of records such as {\"messages\": [...]} or {\"prompt\": ..., "
                "\"completion\": ...}, with data.mixture and data.max_bytes unset (they apply to text). Fix: set "
                "data.path=chats.jsonl and drop the others."
            )


@dataclasses.dataclass(frozen=True)
class InitConfig:
    """Where training starts: random parameters, or (`init.from=RUN_DIR`) the newest checkpoint's parameters of
    another lm run, e.g. one written by `systolic convert from-hf`. The model section and the tokenizer then come
    from that run; the optimizer starts fresh. Once this run has a checkpoint, it resumes from its own."""

    from_: str = ""  # the config key is `init.from` (see systolic.config.config_key)


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """What `generate` does by default, and the sample printed at the end of training."""

    prompt: str = ""  # empty: `generate` starts a fresh document; the sample after training, the data's own text
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        check_seed("sample.seed", self.seed)
        if "\x00" in self.prompt:
            raise ConfigError(
                f"sample.prompt (--prompt) holds a NUL byte at character {self.prompt.index(chr(0))}; a prompt is text, "
                "and tokenizers and terminals stop or fail at NUL. Fix: remove it from the prompt."
            )
        problem = unicode_problem(self.prompt)
        if problem:  # bytes that are not UTF-8 in the command line: no tokenizer can encode it
            raise ConfigError(f"sample.prompt (--prompt) is not Unicode text: {problem}. Expected UTF-8 text. Fix: "
                              "convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove that character.")
        if (not math.isfinite(self.temperature) or self.max_new_tokens < 0 or self.temperature < 0 or self.top_k < 0
                or not 0 < self.top_p <= 1):
            raise ConfigError(
                f"sample settings out of range (max_new_tokens={self.max_new_tokens}, temperature={self.temperature}, "
                f"top_k={self.top_k}, top_p={self.top_p}). Expected max_new_tokens >= 0, temperature >= 0 (0 = greedy), "
                "top_k >= 0 (0 = off), 0 < top_p <= 1. Fix: e.g. --temperature 0.8 --top-p 1."
            )


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


# What a run optimises (`objective`), each post-training objective's sections and the recipe that sets it up.
OBJECTIVES = {"next_token": "lm-small (pretraining) or lm-sft", "dpo": "lm-dpo", "grpo": "lm-grpo"}


@dataclasses.dataclass(frozen=True)
class LMConfig:
    workload: Literal["lm"] = "lm"
    # next_token: the cross-entropy of the data's tokens (pretraining; SFT with data.format=chat). dpo: preference
    # pairs against the init.from reference (the `dpo` section). grpo: rewarded rollouts (`grpo` and `reward`).
    objective: Literal["next_token", "dpo", "grpo"] = "next_token"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: LMTrainConfig = LMTrainConfig()
    loop: LoopConfig = LoopConfig()
    optim: LMOptimConfig = LMOptimConfig()
    mesh: MeshConfig = MeshConfig()
    pipeline: PipelineConfig = PipelineConfig()
    sharding: ShardingConfig = ShardingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    observe: ObserveConfig = ObserveConfig()
    sample: SampleConfig = SampleConfig()
    init: InitConfig = InitConfig()
    dpo: DPOConfig | None = None  # exists (with its defaults if the recipe has none) only when objective=dpo
    grpo: GRPOConfig | None = None  # exists only when objective=grpo
    reward: RewardConfig | None = None  # exists only when objective=grpo

    def __post_init__(self) -> None:
        # The chosen objective's sections, with their defaults when the recipe leaves them out (the config is frozen).
        if self.objective == "dpo" and self.dpo is None:
            object.__setattr__(self, "dpo", DPOConfig())
        if self.objective == "grpo" and self.grpo is None:
            object.__setattr__(self, "grpo", GRPOConfig())
        if self.objective == "grpo" and self.reward is None:
            object.__setattr__(self, "reward", RewardConfig())

    def validate(self) -> None:
        self._check_objective()
        if self.optim.name == "muon" and self.model.lora.rank:
            raise ConfigError(
                f"optim.name=muon with model.lora.rank={self.model.lora.rank}: a LoRA run trains only the low-rank "
                "adapters, which take AdamW, so Muon would move nothing. Fix: optim.name=adamw for LoRA, or drop "
                "model.lora to train the whole model with Muon."
            )
        self._check_context()
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} is longer than model.max_seq_len={self.model.max_seq_len}; the "
                f"model cannot attend over that many positions. Fix: set model.max_seq_len={self.data.seq_len} or shorten data.seq_len."
            )

    def _check_objective(self) -> None:
        """Only the chosen objective's sections exist; post-training starts from a trained run."""
        owners = {"dpo": "dpo", "grpo": "grpo", "reward": "grpo"}
        for section, owner in owners.items():
            if getattr(self, section) is not None and self.objective != owner:
                raise ConfigError(
                    f"The config has a '{section}' section but objective={self.objective}, so those settings would "
                    f"not act: the section belongs to objective={owner}. Fix: start from the recipe of the objective "
                    f"you want ({', '.join(f'{o}: --recipe {r}' for o, r in OBJECTIVES.items())}), or drop the "
                    f"{section}.* settings."
                )
        if self.objective != "next_token":
            self._check_post_data()
        if self.objective != "next_token" and not self.init.from_:
            raise ConfigError(
                f"objective={self.objective} post-trains a model, but init.from is not set, so the policy (and its "
                "reference) would be random. Expected init.from naming a trained or imported lm run. Fix: add "
                f"init.from=runs/sft (e.g. `systolic train lm --recipe {OBJECTIVES[self.objective][3:]} "
                "init.from=runs/sft data.path=...`)."
            )

    def _check_post_data(self) -> None:
        """The other sections' settings that a post-training run reads its own way (pairs, prompts), or not at all."""
        data = self.data
        ignored = {key: value for key, value in (
            ("data.format", data.format if data.format != "text" else ""), ("data.mixture", data.mixture),
            ("data.max_bytes", data.max_bytes), ("data.packing", "concat" if data.packing == "concat" else ""),
            ("optim.z_loss", self.optim.z_loss)) if value}
        if data.path and not ignored:
            return
        got = ", ".join(f"{k}={v!r}" for k, v in ignored.items()) or "data.path=''"
        records, example, each = {
            "dpo": ("preference pairs", '{"prompt": ..., "chosen": ..., "rejected": ...}', "each sequence attends "
                    "only to itself"),
            "grpo": ("prompt records", '{"prompt": ..., "answer": ...}', "each row one prompt and its completion"),
        }[self.objective]
        raise ConfigError(
            f"objective={self.objective} reads {records} from data.path, but got {got}. Expected data.path naming a "
            f".jsonl file (or a folder of them) of records such as {example}, packed as documents "
            f"(data.packing=documents: {each}), with data.format, data.mixture, data.max_bytes and optim.z_loss at "
            "their defaults (they apply to next-token training). Fix: start from the recipe, `systolic train lm "
            f"--recipe {self.objective} init.from=RUN data.path=FILE.jsonl`, and drop the others."
        )

    def _check_context(self) -> None:
        """Context parallelism (mesh.context, workloads/lm/parallel/context.py): its attention setting applies only when the
        sequence is split, and replaces model.attention's implementations. (The sequence length is checked against
        the mesh, whose context axis may be -1 here, by `context.check_seq_len`.)"""
        context, m = self.mesh.context, self.model
        if context == 1 and m.context_attention != "ring":
            raise ConfigError(
                f"model.context_attention={m.context_attention} chooses how attention runs when mesh.context > 1 "
                "splits each sequence, but mesh.context=1, so it would do nothing. Fix: set mesh.context (e.g. "
                "mesh.context=2), or drop model.context_attention."
            )
        if context != 1 and m.attn_logit_softcap:
            raise ConfigError(
                f"model.attn_logit_softcap={m.attn_logit_softcap} with mesh.context={context}: the split sequence's "
                "ring and allgather attention (workloads/lm/parallel/context.py) do not soft-cap the logits. Fix: "
                "mesh.context=1 (split the model with mesh.fsdp or mesh.tensor instead)."
            )
        if context != 1 and m.attention != "auto":
            raise ConfigError(
                f"model.attention={m.attention} with mesh.context={context}: a split sequence runs attention as "
                f"model.context_attention={m.context_attention} (ring or allgather, workloads/lm/parallel/context.py), not "
                "through the single-device kernels. Fix: model.attention=auto, or mesh.context=1."
            )
