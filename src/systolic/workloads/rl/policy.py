"""The actor-critic network and the two action distributions PPO needs (categorical and diagonal Gaussian).

Actor and critic are separate MLPs, initialised as in PureJaxRL/CleanRL: orthogonal weights with gain sqrt(2) in
hidden layers, 0.01 on the policy head (near-uniform first policy) and 1.0 on the value head, zero biases.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.workloads.rl.config import NetworkConfig
from systolic.workloads.rl.env_api import EnvSpec

_LOG_2PI = math.log(2 * math.pi)


def pick(values: jax.Array, action: jax.Array) -> jax.Array:
    """values[..., action] for each row: (..., A), (...) int -> (...). A select and a sum over the few actions, not a
    gather: on the TPU a gather of one element a row ran at ~2 GB/s (benchmarks/peers/rl_profile.py, 2026-12-07), and
    its gradient is a scatter (PPO's log-probabilities that way: 21% of a 2,048-environment update there); the select
    fuses with its neighbours. Exact: one value plus zeros."""
    hit = action[..., None].astype(jnp.int32) == jnp.arange(values.shape[-1], dtype=jnp.int32)  # (..., A)
    return jnp.where(hit, values, 0).sum(axis=-1)


class Categorical(NamedTuple):
    logits: jax.Array  # (..., A)

    def log_prob(self, action: jax.Array) -> jax.Array:
        return pick(jax.nn.log_softmax(self.logits), action)

    def entropy(self) -> jax.Array:
        log_p = jax.nn.log_softmax(self.logits)
        return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)

    def sample(self, noise: jax.Array) -> jax.Array:
        """Gumbel-max: `noise` is standard Gumbel noise of the logits' shape (see `action_noise`)."""
        return jnp.argmax(self.logits + noise, axis=-1).astype(jnp.int32)

    def mode(self) -> jax.Array:
        return jnp.argmax(self.logits, axis=-1).astype(jnp.int32)


class DiagGaussian(NamedTuple):
    mean: jax.Array  # (..., D)
    log_std: jax.Array  # (D,) or (..., D)

    def log_prob(self, action: jax.Array) -> jax.Array:
        z = (action - self.mean) * jnp.exp(-self.log_std)
        return jnp.sum(-0.5 * z**2 - self.log_std - 0.5 * _LOG_2PI, axis=-1)

    def entropy(self) -> jax.Array:
        log_std = jnp.broadcast_to(self.log_std, self.mean.shape)
        return jnp.sum(log_std + 0.5 * (1.0 + _LOG_2PI), axis=-1)

    def sample(self, noise: jax.Array) -> jax.Array:
        """`noise` is standard normal noise of the mean's shape (see `action_noise`)."""
        return self.mean + jnp.exp(self.log_std) * noise

    def mode(self) -> jax.Array:
        return self.mean


Distribution = Categorical | DiagGaussian


def action_noise(spec: EnvSpec, shape: tuple[int, ...], *, key: jax.Array) -> jax.Array:
    """The randomness of `shape` action samples, drawn at once: (*shape, actions) Gumbel noise for a categorical
    policy, (*shape, action_dim) standard normal noise for a Gaussian one. Drawn in bulk outside the rollout loop
    for the reason given in envs.py (threefry is a loop of its own on CPU)."""
    if spec.discrete:
        return jax.random.gumbel(key, (*shape, spec.action_dim))
    return jax.random.normal(key, (*shape, spec.action_dim))


class MLP(nnx.Module):
    def __init__(self, sizes: list[int], activation: str, out_gain: float, *, rngs: nnx.Rngs):
        gains = [math.sqrt(2.0)] * (len(sizes) - 2) + [out_gain]
        self.layers = nnx.List([
            nnx.Linear(d_in, d_out, kernel_init=nnx.initializers.orthogonal(gain),
                       bias_init=nnx.initializers.zeros_init(), rngs=rngs)
            for d_in, d_out, gain in zip(sizes[:-1], sizes[1:], gains)
        ])
        self.activation = jnp.tanh if activation == "tanh" else jax.nn.relu

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = self.activation(layer(x))
        return self.layers[-1](x)


class ActorCritic(nnx.Module):
    def __init__(self, spec: EnvSpec, cfg: NetworkConfig, *, rngs: nnx.Rngs):
        hidden = [cfg.hidden] * cfg.layers
        self.discrete = spec.discrete
        self.actor = MLP([spec.obs_size, *hidden, spec.action_dim], cfg.activation, 0.01, rngs=rngs)
        self.critic = MLP([spec.obs_size, *hidden, 1], cfg.activation, 1.0, rngs=rngs)
        if not spec.discrete:
            self.log_std = nnx.Param(jnp.full((spec.action_dim,), cfg.init_log_std, jnp.float32))

    def __call__(self, obs: jax.Array, n_obs_axes: int) -> tuple[Distribution, jax.Array]:
        """obs (..., *obs_shape) -> (action distribution over (...), value (...))."""
        x = obs.reshape(*obs.shape[:obs.ndim - n_obs_axes], -1)  # (..., obs_size)
        head = self.actor(x)  # (..., A)
        dist = Categorical(head) if self.discrete else DiagGaussian(head, self.log_std[...])
        return dist, self.critic(x)[..., 0]

    def value(self, obs: jax.Array, n_obs_axes: int) -> jax.Array:
        x = obs.reshape(*obs.shape[:obs.ndim - n_obs_axes], -1)
        return self.critic(x)[..., 0]


def make_graphdef(spec: EnvSpec, cfg: NetworkConfig) -> nnx.GraphDef:
    """The network's structure without weights: what `apply` merges parameters into inside jitted code."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: ActorCritic(spec, cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return graphdef


def init_params(spec: EnvSpec, cfg: NetworkConfig, *, key: jax.Array) -> dict[str, Any]:
    """Fresh parameters as a pure dict (what the train state and the checkpoints hold)."""
    return nnx.to_pure_dict(nnx.state(ActorCritic(spec, cfg, rngs=nnx.Rngs(params=key)), nnx.Param))


def apply(graphdef: nnx.GraphDef, params: dict[str, Any], obs: jax.Array, n_obs_axes: int) -> tuple[Distribution, jax.Array]:
    return nnx.merge(graphdef, params)(obs, n_obs_axes)


def value(graphdef: nnx.GraphDef, params: dict[str, Any], obs: jax.Array, n_obs_axes: int) -> jax.Array:
    return nnx.merge(graphdef, params).value(obs, n_obs_axes)
