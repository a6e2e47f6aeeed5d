"""The Q-network of the value-based algorithms (PQN, DQN): one Q-value per discrete action.

An MLP with a LayerNorm after every hidden layer (purejaxql's `QNetwork`, norm_type=layer_norm, Flax's default
initialisers). With `model.conv_channels > 0` and image observations (H, W, C), a convolution comes first:
purejaxql's MinAtar CNN, a 3x3 VALID convolution of `conv_channels` filters, LayerNorm over the channels, relu,
flattened into the MLP, with He-normal weights in the convolution and the hidden layers as there.

purejaxql divides MinAtar observations by 255 before the convolution, a habit from Atari pixels; MinAtar's channels
are already 0/1, and the division makes the convolution's output 255 times smaller than its bias's updates, so we
feed the observations as they are.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.errors import ConfigError
from systolic.workloads.rl.config import NetworkConfig
from systolic.workloads.rl.env_api import EnvSpec


class QNetwork(nnx.Module):
    def __init__(self, spec: EnvSpec, cfg: NetworkConfig, *, rngs: nnx.Rngs):
        check_conv(spec, cfg)
        self.n_obs_axes = len(spec.obs_shape)
        he = nnx.initializers.he_normal()
        if cfg.conv_channels:
            height, width, channels = spec.obs_shape
            self.conv = nnx.Conv(channels, cfg.conv_channels, kernel_size=(3, 3), padding="VALID", kernel_init=he,
                                 rngs=rngs)
            self.conv_norm = nnx.LayerNorm(cfg.conv_channels, rngs=rngs)
            in_size = (height - 2) * (width - 2) * cfg.conv_channels  # VALID 3x3: each side loses 2
            dense_init = {"kernel_init": he}
        else:
            self.conv = None
            in_size, dense_init = spec.obs_size, {}
        sizes = [in_size] + [cfg.hidden] * cfg.layers
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs, **dense_init) for a, b in zip(sizes[:-1], sizes[1:])])
        self.norms = nnx.List([nnx.LayerNorm(cfg.hidden, rngs=rngs) for _ in range(cfg.layers)])
        self.head = nnx.Linear(cfg.hidden, spec.action_dim, rngs=rngs)
        self.activation = jnp.tanh if cfg.activation == "tanh" else jax.nn.relu

    def __call__(self, obs: jax.Array) -> jax.Array:
        """obs (..., *obs_shape) -> Q-values (..., A)."""
        batch_shape = obs.shape[:obs.ndim - self.n_obs_axes]
        if self.conv is not None:
            x = obs.reshape(-1, *obs.shape[-3:])  # (B, H, W, C)
            x = jax.nn.relu(self.conv_norm(self.conv(x)))  # (B, H-2, W-2, conv_channels)
            x = x.reshape(*batch_shape, -1)  # (..., (H-2)(W-2)conv_channels)
        else:
            x = obs.reshape(*batch_shape, -1)  # (..., obs_size)
        for layer, norm in zip(self.layers, self.norms):
            x = self.activation(norm(layer(x)))
        return self.head(x)


def check_conv(spec: EnvSpec, cfg: NetworkConfig) -> None:
    if cfg.conv_channels and (len(spec.obs_shape) != 3 or min(spec.obs_shape[:2]) < 3):
        raise ConfigError(
            f"model.conv_channels={cfg.conv_channels} on {spec.name}, whose observations have shape "
            f"{spec.obs_shape}: the convolution needs images (height, width, channels) of at least 3 x 3. Fix: "
            "model.conv_channels=0 for flat observations (an MLP), or an image environment (Breakout-MinAtar, ...)."
        )


def make_graphdef(spec: EnvSpec, cfg: NetworkConfig) -> nnx.GraphDef:
    """The network's structure without weights: what `q_values` merges parameters into inside jitted code."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: QNetwork(spec, cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return graphdef


def init_params(spec: EnvSpec, cfg: NetworkConfig, *, key: jax.Array) -> dict[str, Any]:
    """Fresh parameters as a pure dict (what the train state and the checkpoints hold)."""
    return nnx.to_pure_dict(nnx.state(QNetwork(spec, cfg, rngs=nnx.Rngs(params=key)), nnx.Param))


def q_values(graphdef: nnx.GraphDef, params: dict[str, Any], obs: jax.Array) -> jax.Array:
    """obs (..., *obs_shape) -> (..., A)."""
    return nnx.merge(graphdef, params)(obs)
