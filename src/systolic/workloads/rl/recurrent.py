"""PPO's recurrent actor-critic (`model.gru_size` > 0), as PureJaxRL's `ppo_rnn.py`: one dense embedding layer,
a GRU cell, then separate actor and critic heads on the GRU's output.

The GRU's hidden state is the policy's memory of the episode: zeros at an episode's start, reset to zeros after the
step that ends it. `step` advances it by one observation (acting); `unroll` replays a whole rollout from its first
hidden state (the update), resetting where episodes ended exactly as the rollout did, so the update sees the
hidden states the actions were chosen with.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.workloads.rl.config import NetworkConfig
from systolic.workloads.rl.env_api import EnvSpec
from systolic.workloads.rl.policy import MLP, Categorical, DiagGaussian, Distribution


class RecurrentActorCritic(nnx.Module):
    def __init__(self, spec: EnvSpec, cfg: NetworkConfig, *, rngs: nnx.Rngs):
        self.discrete = spec.discrete
        self.activation = jnp.tanh if cfg.activation == "tanh" else jax.nn.relu
        self.embed = nnx.Linear(spec.obs_size, cfg.hidden, kernel_init=nnx.initializers.orthogonal(math.sqrt(2.0)),
                                bias_init=nnx.initializers.zeros_init(), rngs=rngs)
        # flax's GRU cell: orthogonal recurrent weights, zero biases (PureJaxRL's linen GRUCell has the same).
        self.gru = nnx.GRUCell(cfg.hidden, cfg.gru_size, rngs=rngs)
        heads = [cfg.gru_size] + [cfg.hidden] * (cfg.layers - 1)  # the embedding is the first of `layers`
        self.actor = MLP([*heads, spec.action_dim], cfg.activation, 0.01, rngs=rngs)
        self.critic = MLP([*heads, 1], cfg.activation, 1.0, rngs=rngs)
        if not spec.discrete:
            self.log_std = nnx.Param(jnp.full((spec.action_dim,), cfg.init_log_std, jnp.float32))

    def __call__(self, hidden: jax.Array, obs: jax.Array, n_obs_axes: int) -> tuple[jax.Array, Distribution, jax.Array]:
        """hidden (..., H), obs (..., *obs_shape) -> (next hidden (..., H), action distribution, value (...))."""
        x = obs.reshape(*obs.shape[:obs.ndim - n_obs_axes], -1)  # (..., obs_size)
        hidden, y = self.gru(hidden, self.activation(self.embed(x)))  # (..., H) both
        head = self.actor(y)  # (..., A)
        dist = Categorical(head) if self.discrete else DiagGaussian(head, self.log_std[...])
        return hidden, dist, self.critic(y)[..., 0]


def make_graphdef(spec: EnvSpec, cfg: NetworkConfig) -> nnx.GraphDef:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: RecurrentActorCritic(spec, cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return graphdef


def init_params(spec: EnvSpec, cfg: NetworkConfig, *, key: jax.Array) -> dict[str, Any]:
    """Fresh parameters as a pure dict (what the train state and the checkpoints hold)."""
    return nnx.to_pure_dict(nnx.state(RecurrentActorCritic(spec, cfg, rngs=nnx.Rngs(params=key)), nnx.Param))


def step(graphdef: nnx.GraphDef, params: dict[str, Any], hidden: jax.Array, obs: jax.Array,
         n_obs_axes: int) -> tuple[jax.Array, Distribution, jax.Array]:
    """One observation through the network: (next hidden, distribution, value); no reset."""
    return nnx.merge(graphdef, params)(hidden, obs, n_obs_axes)


def unroll(graphdef: nnx.GraphDef, params: dict[str, Any], hidden: jax.Array, obs: jax.Array, done: jax.Array,
           n_obs_axes: int) -> tuple[Distribution, jax.Array, jax.Array]:
    """Replays a rollout: hidden (B, H) before its first step, obs (T, B, *obs_shape), done (T, B) the episode
    ended at step t. Returns the distributions and values of every step, (T, B), and the hidden state after each
    step before any reset, (T, B, H) (what a truncated episode's bootstrap value needs)."""

    def body(h, inputs):
        obs_t, done_t = inputs
        h_next, dist, value = step(graphdef, params, h, obs_t, n_obs_axes)
        # A new episode starts with no memory: the same reset as in the rollout.
        return jnp.where(done_t[:, None], 0.0, h_next), (dist, value, h_next)

    _, (dist, values, hiddens) = jax.lax.scan(body, hidden, (obs, done))
    return dist, values, hiddens
