"""The `rl` workload's config: environment, network, algorithm and run-shape sections plus the engine's common ones.

`algo` picks the algorithm, PPO, PQN or DQN; only the chosen one's section (`ppo`, `pqn` or `dqn`) exists in a
config, so a PPO run has no PQN or DQN key, and so on. One loop step of the engine is one *chunk*:
`rl.updates_per_chunk` updates compiled into one program, each update collecting `rl.num_steps` steps from each of
`rl.num_envs` environments, for each of `rl.num_seeds` independent seeds at once. Derived counts (updates, chunks,
environment steps) are properties.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from systolic.config import (CheckpointConfig, LoopConfig, MeshConfig, ObserveConfig, check_in_range, check_positive,
                             check_seed, divisor_near)
from systolic.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """A gymnax environment by its registered name (classic control, MinAtar, bsuite), or a Brax one (MuJoCo
    continuous control) as `brax/<name>`, e.g. `brax/inverted_pendulum` (needs `pip install 'systolic[control]'`)."""

    name: str = "CartPole-v1"
    # 0: the environment's own limit (500 for CartPole-v1, 200 for Pendulum-v1, 1000 for Brax's)
    max_episode_steps: int = 0
    # Flat observation components the agent sees as 0, making any environment partially observed: CartPole-v1
    # with [1, 3] hides both velocities ("stateless CartPole"). Checked against the observation size in envs.py.
    hide_obs: tuple[int, ...] = ()

    def validate(self) -> None:
        if self.max_episode_steps < 0:
            raise ConfigError(
                f"env.max_episode_steps={self.max_episode_steps} must be >= 0 (0 keeps the environment's own "
                "episode limit). Fix: e.g. env.max_episode_steps=0."
            )
        if len(set(self.hide_obs)) != len(self.hide_obs):
            raise ConfigError(
                f"env.hide_obs={list(self.hide_obs)} names a component twice. Expected: distinct indices into the "
                f"flattened observation. Fix: e.g. env.hide_obs={sorted(set(self.hide_obs))}."
            )


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
    """The `model` section. PPO: separate actor and critic MLPs (PureJaxRL's layout), or with `gru_size` > 0 a dense
    embedding and a GRU cell shared by actor and critic heads (recurrent.py, PureJaxRL's `ppo_rnn.py`); continuous
    actions are Gaussian with a learned, state-independent log standard deviation. PQN and DQN: one Q-network MLP with a
    LayerNorm after every hidden layer (purejaxql's), after a convolution for image observations when
    `conv_channels` > 0 (qnetwork.py). Named `model` because the engine refuses to resume a run directory whose
    `model` changed (its checkpoints would not fit)."""

    hidden: int = 64
    layers: int = 2
    activation: Literal["tanh", "relu"] = "tanh"
    init_log_std: float = 0.0
    conv_channels: int = 0  # Q-networks on images (MinAtar): first a 3x3 convolution of this many filters; 0: none
    # PPO with memory (recurrent.py): > 0 puts a GRU cell of this size after a first dense layer of `hidden` units,
    # shared by the actor and critic heads (each `layers - 1` hidden layers); 0: the feed-forward MLPs.
    gru_size: int = 0

    def validate(self) -> None:
        if self.gru_size < 0:
            raise ConfigError(f"model.gru_size={self.gru_size} must be >= 0 (0: a feed-forward policy). Fix: e.g. "
                              "model.gru_size=128 for a recurrent PPO policy, 0 for none.")
        if self.conv_channels < 0:
            raise ConfigError(f"model.conv_channels={self.conv_channels} must be >= 0 (0: no convolution). Fix: e.g. "
                              "model.conv_channels=16 for MinAtar, 0 for flat observations.")
        if self.hidden <= 0 or self.layers <= 0:
            raise ConfigError(
                f"model.hidden={self.hidden} and model.layers={self.layers} must both be greater than 0. Fix: "
                "e.g. model.hidden=64 model.layers=2."
            )


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """The PPO objective and its optimizer (Adam, global-norm clipping, optional linear learning-rate decay)."""

    lr: float = 2.5e-4
    anneal_lr: bool = True  # linear decay to 0 over the whole run
    adam_eps: float = 1e-5
    max_grad_norm: float = 0.5
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    clip_value: bool = True  # clip the value update to +-clip_eps around the rollout's values
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    update_epochs: int = 4
    num_minibatches: int = 4
    normalize_advantages: bool = True  # per minibatch
    normalize_obs: bool = False  # running mean/variance of observations, kept in the checkpoint
    reward_scale: float = 1.0  # rewards are multiplied by this before GAE (returns reported unscaled)

    def validate(self) -> None:
        check_positive(self, "ppo", ("lr", "adam_eps", "max_grad_norm", "clip_eps", "reward_scale"))
        check_in_range(self, "ppo", ("gamma", "gae_lambda"), 0, 1, why="it is a discount factor")
        if self.ent_coef < 0 or self.vf_coef < 0:
            raise ConfigError(f"ppo.ent_coef={self.ent_coef} and ppo.vf_coef={self.vf_coef} must both be >= 0. Fix: "
                              "use 0 to switch a term off.")
        if self.update_epochs <= 0 or self.num_minibatches <= 0:
            raise ConfigError(f"ppo.update_epochs={self.update_epochs} and ppo.num_minibatches={self.num_minibatches} "
                              "must both be greater than 0. Fix: e.g. ppo.update_epochs=4 ppo.num_minibatches=4.")


@dataclasses.dataclass(frozen=True)
class PQNConfig:
    """Parallel Q-learning (PQN, purejaxql's `pqn_gymnax.py`): epsilon-greedy rollouts from every environment, Q(lambda)
    targets, minibatch epochs of RAdam on the squared TD error; no replay buffer, no target network. Discrete
    actions only."""

    lr: float = 1e-4
    anneal_lr: bool = True  # linear decay to 0 over the whole run
    max_grad_norm: float = 10.0
    gamma: float = 0.99
    q_lambda: float = 0.95  # lambda of the Q(lambda) targets: 0 is one-step Q-learning, 1 the Monte Carlo return
    update_epochs: int = 4
    num_minibatches: int = 16
    eps_start: float = 1.0  # epsilon-greedy exploration: the chance of a uniformly random action...
    eps_finish: float = 0.05  # ...falls linearly to this...
    eps_decay: float = 0.2  # ...over this fraction of the run's updates, then stays
    reward_scale: float = 1.0  # rewards are multiplied by this before the targets (returns reported unscaled)

    def validate(self) -> None:
        check_positive(self, "pqn", ("lr", "max_grad_norm", "reward_scale", "eps_decay"))
        check_in_range(self, "pqn", ("gamma", "q_lambda", "eps_start", "eps_finish"), 0, 1)
        if self.update_epochs <= 0 or self.num_minibatches <= 0:
            raise ConfigError(f"pqn.update_epochs={self.update_epochs} and pqn.num_minibatches={self.num_minibatches} "
                              "must both be greater than 0. Fix: e.g. pqn.update_epochs=4 pqn.num_minibatches=16.")


@dataclasses.dataclass(frozen=True)
class DQNConfig:
    """DQN (Mnih et al. 2015, as purejaxrl's `dqn.py`): epsilon-greedy steps go into a uniform replay buffer held on
    the device (replay.py); each update takes `gradient_steps` Adam steps on minibatches sampled from it, with
    one-step targets from a target network copied from the online one every `target_update_every` environment steps.
    Discrete actions only."""

    lr: float = 2.5e-4
    anneal_lr: bool = False  # linear decay to 0 over the whole run
    max_grad_norm: float = 10.0
    gamma: float = 0.99
    buffer_size: int = 10_000  # transitions per seed; the oldest are overwritten once full
    batch_size: int = 128  # transitions sampled per gradient step
    gradient_steps: int = 1  # per update (each update adds rl.num_envs x rl.num_steps transitions)
    learning_starts: int = 10_000  # environment steps per seed before the first gradient step
    target_update_every: int = 500  # environment steps per seed between copies into the target network
    eps_start: float = 1.0  # epsilon-greedy exploration: the chance of a uniformly random action...
    eps_finish: float = 0.05  # ...falls linearly to this...
    eps_decay: float = 0.5  # ...over this fraction of the run's updates, then stays

    def validate(self) -> None:
        check_positive(self, "dqn", ("lr", "max_grad_norm", "eps_decay", "buffer_size", "batch_size", "gradient_steps",
                                     "target_update_every"))
        check_in_range(self, "dqn", ("gamma", "eps_start", "eps_finish"), 0, 1)
        if self.learning_starts < 0:
            raise ConfigError(f"dqn.learning_starts={self.learning_starts} must be >= 0 (0: learn from the first "
                              "update). Fix: e.g. dqn.learning_starts=10000.")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How much experience, in what shape: seeds x environments x rollout steps, chunked for the engine's loop."""

    num_seeds: int = 8  # independent training runs, vmapped
    num_envs: int = 4  # environments per seed
    num_steps: int = 128  # rollout length per update
    total_env_steps: int = 500_000  # per seed; rounded up to whole chunks
    updates_per_chunk: int = 16  # updates per compiled loop step (one metrics row, one checkpoint unit)
    eval_every: int = 0  # chunks between evaluations; 0 = only at the end
    eval_episodes: int = 16  # per seed, deterministic policy
    seed: int = 0
    # Rollout steps per iteration of the rollout's `lax.scan` (its `unroll`; every algorithm). Tiny environments make
    # each step a few microsecond-sized kernels, so on an accelerator the loop's per-iteration overhead can cost as
    # much as the step; unrolling trades it for a longer program. Need not divide num_steps (the scan runs the
    # remainder after the loop); results equal unroll=1's up to floating-point order.
    unroll: int = 1

    @property
    def env_steps_per_update(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_chunks(self) -> int:
        per_chunk = self.env_steps_per_update * self.updates_per_chunk
        return max(1, -(-self.total_env_steps // per_chunk))

    @property
    def num_updates(self) -> int:
        return self.num_chunks * self.updates_per_chunk

    @property
    def env_steps_per_chunk(self) -> int:
        """Per seed."""
        return self.env_steps_per_update * self.updates_per_chunk

    def validate(self) -> None:
        check_positive(self, "rl", ("num_seeds", "num_envs", "num_steps", "total_env_steps", "updates_per_chunk",
                                    "eval_episodes"))
        if self.unroll < 1:
            raise ConfigError(f"rl.unroll={self.unroll} must be >= 1: it is how many rollout steps one iteration of the "
                              "rollout loop runs (1: no unrolling). Fix: e.g. rl.unroll=1, or rl.unroll=8 to cut the "
                              "loop's overhead on an accelerator.")
        check_seed("rl.seed", self.seed)
        if self.eval_every < 0:
            raise ConfigError(f"rl.eval_every={self.eval_every} must be >= 0 (0 = evaluate only at the end). Fix: "
                              "e.g. rl.eval_every=10.")


# Each algorithm (the `algo` values) and its CartPole recipe, named in errors.
ALGORITHMS = {"ppo": "rl-cartpole", "pqn": "rl-cartpole-pqn", "dqn": "rl-cartpole-dqn"}


@dataclasses.dataclass(frozen=True)
class RLConfig:
    workload: Literal["rl"] = "rl"
    algo: Literal["ppo", "pqn", "dqn"] = "ppo"
    env: EnvConfig = EnvConfig()
    model: NetworkConfig = NetworkConfig()
    ppo: PPOConfig | None = None  # exists (with its defaults if the recipe has none) only when algo=ppo
    pqn: PQNConfig | None = None  # exists only when algo=pqn
    dqn: DQNConfig | None = None  # exists only when algo=dqn
    rl: RunConfig = RunConfig()
    loop: LoopConfig = LoopConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    observe: ObserveConfig = ObserveConfig()

    def __post_init__(self) -> None:
        # The chosen algorithm's section, with its defaults when the recipe leaves it out (the config is frozen).
        if self.algo == "ppo" and self.ppo is None:
            object.__setattr__(self, "ppo", PPOConfig())
        if self.algo == "pqn" and self.pqn is None:
            object.__setattr__(self, "pqn", PQNConfig())
        if self.algo == "dqn" and self.dqn is None:
            object.__setattr__(self, "dqn", DQNConfig())

    def validate(self) -> None:
        if self.algo == "ppo" and self.model.conv_channels:
            raise ConfigError(
                f"model.conv_channels={self.model.conv_channels} with algo=ppo: PPO's actor and critic are MLPs on the "
                "flattened observation; only the Q-networks (algo=pqn, algo=dqn) have a convolution. Fix: "
                "model.conv_channels=0, or train image environments with PQN (--recipe rl-breakout-pqn)."
            )
        if self.algo != "ppo" and self.model.gru_size:
            raise ConfigError(
                f"model.gru_size={self.model.gru_size} with algo={self.algo}: only PPO has a recurrent policy; "
                f"{self.algo.upper()}'s Q-network sees one observation at a time. Fix: model.gru_size=0, or train a "
                "policy with memory with PPO (--recipe rl-cartpole-gru)."
            )
        if self.algo == "ppo" and self.model.gru_size and self.rl.num_envs % self.ppo.num_minibatches:
            raise ConfigError(
                f"rl.num_envs={self.rl.num_envs} cannot be split into ppo.num_minibatches={self.ppo.num_minibatches} "
                f"equal groups: with model.gru_size={self.model.gru_size} a minibatch is a set of environments whose "
                "whole rollouts are replayed through the GRU, not a set of single steps. Fix: set "
                f"ppo.num_minibatches={divisor_near(self.rl.num_envs, self.ppo.num_minibatches)}, or rl.num_envs to a "
                f"multiple of {self.ppo.num_minibatches}."
            )
        for other in ALGORITHMS:
            if other != self.algo and getattr(self, other) is not None:
                raise ConfigError(
                    f"The config has a '{other}' section but algo={self.algo}, so those settings would not act. "
                    f"Expected: only the section of the chosen algorithm. Fix: start from a recipe of the algorithm "
                    f"you want ({', '.join(f'{a.upper()}: --recipe {r}' for a, r in ALGORITHMS.items())}), or drop "
                    f"the {other}.* settings."
                )
        batch = self.rl.env_steps_per_update
        if self.algo in ("ppo", "pqn"):
            self._check_minibatches(batch, getattr(self, self.algo).num_minibatches)
        if self.algo == "dqn" and self.dqn.buffer_size < batch:
            raise ConfigError(
                f"dqn.buffer_size={self.dqn.buffer_size} is smaller than the {batch} transitions one update adds "
                f"(rl.num_envs x rl.num_steps = {self.rl.num_envs} x {self.rl.num_steps}), so an update would "
                f"overwrite its own transitions. Fix: dqn.buffer_size >= {batch}, e.g. "
                f"dqn.buffer_size={max(batch, 10_000)}."
            )
        if self.mesh.tensor != 1 or self.mesh.expert != 1 or self.mesh.context != 1 or self.mesh.stage != 1:
            raise ConfigError(
                f"mesh.tensor={self.mesh.tensor}, mesh.expert={self.mesh.expert}, mesh.context={self.mesh.context} and "
                f"mesh.stage={self.mesh.stage}: the rl workload splits seeds or environments over the data-parallel "
                "axes (data, fsdp) only; its networks are too small to split and have no experts, sequences or layer "
                "stages. Fix: mesh.tensor=1 mesh.expert=1 mesh.context=1 mesh.stage=1 (e.g. mesh.data=-1 mesh.fsdp=1)."
            )

    def _check_minibatches(self, batch: int, num_minibatches: int) -> None:
        if batch % num_minibatches:
            key = f"{self.algo}.num_minibatches"
            raise ConfigError(
                f"rl.num_envs x rl.num_steps = {self.rl.num_envs} x {self.rl.num_steps} = {batch} transitions per "
                f"update cannot be split into {key}={num_minibatches} equal minibatches. Fix: choose sizes whose "
                f"product is a multiple of {num_minibatches}, or set {key}={divisor_near(batch, num_minibatches)}."
            )
