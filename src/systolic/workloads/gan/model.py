"""DCGAN networks in Flax NNX, NHWC, sized for 8/16/32/64-pixel images.

The generator starts from a 4x4 feature map and doubles the resolution with stride-2 transposed convolutions
(BatchNorm + ReLU after each); the discriminator mirrors it with stride-2 convolutions and LeakyReLU, no
normalisation unless spectral normalisation is on. Conditional models embed the label into the generator's input
and score it in the discriminator by projection (Miyato & Koyama 2018).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.workloads.gan.config import ModelConfig

NUM_CLASSES = 10  # digits; unused unless conditional


def num_upsamples(size: int) -> int:
    return int(math.log2(size // 4))


class SpectralConv(nnx.Module):
    """A convolution (or dense layer, with `kernel_size=(1, 1)` on a 1x1 map) whose kernel is divided by its
    largest singular value, estimated by one power iteration per training call with the vector `u` kept as
    state (a BatchStat: not trained, saved with the checkpoint)."""

    def __init__(self, in_features: int, out_features: int, kernel_size: tuple[int, int], strides: int, *,
                 spectral: bool, rngs: nnx.Rngs):
        self.conv = nnx.Conv(in_features, out_features, kernel_size, strides=strides, padding="SAME", rngs=rngs)
        self.spectral = spectral
        self.strides = strides
        if spectral:
            u = jax.random.normal(rngs.params(), (out_features,))
            self.u = nnx.BatchStat(u / jnp.linalg.norm(u))

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        if not self.spectral:
            return self.conv(x)
        kernel = self.conv.kernel[...]
        w = kernel.reshape(-1, kernel.shape[-1])  # (kh * kw * in, out)
        u = self.u[...]
        v = _normalize(w @ u)  # (kh * kw * in,)
        u_new = jax.lax.stop_gradient(_normalize(w.T @ v))  # (out,)
        sigma = jax.lax.stop_gradient(v) @ w @ u_new  # the gradient flows through w only, as in the paper
        if train:
            self.u[...] = u_new
        y = jax.lax.conv_general_dilated(x, kernel / sigma, (self.strides, self.strides), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))  # (B, H/s, W/s, out)
        return y + self.conv.bias[...]


def _normalize(x: jax.Array) -> jax.Array:
    return x / (jnp.linalg.norm(x) + 1e-12)


class Generator(nnx.Module):
    def __init__(self, cfg: ModelConfig, size: int, channels: int, *, conditional: bool, rngs: nnx.Rngs):
        self.conditional = conditional
        self.n_up = num_upsamples(size)
        width = cfg.g_channels
        self.width = width
        in_dim = cfg.latent_dim + (NUM_CLASSES if conditional else 0)
        self.project = nnx.Linear(in_dim, 4 * 4 * width, use_bias=False, rngs=rngs)  # BatchNorm follows: a bias would only add noise
        self.project_norm = nnx.BatchNorm(4 * 4 * width, momentum=0.9, rngs=rngs)
        ups, norms = [], []
        for i in range(self.n_up):
            out = max(width // 2 ** (i + 1), 16)
            ups.append(nnx.ConvTranspose(width if i == 0 else max(width // 2 ** i, 16), out, (4, 4), strides=(2, 2),
                                         padding="SAME", use_bias=False, rngs=rngs))
            norms.append(nnx.BatchNorm(out, momentum=0.9, rngs=rngs))
        self.ups = nnx.List(ups)
        self.norms = nnx.List(norms)
        last = max(width // 2 ** self.n_up, 16)
        self.to_image = nnx.Conv(last, channels, (3, 3), padding="SAME", rngs=rngs)

    def __call__(self, z: jax.Array, labels: jax.Array | None = None, *, train: bool) -> jax.Array:
        """z (B, latent) [labels (B,)] -> images (B, size, size, C) in [-1, 1]. BatchNorm uses the batch's own
        statistics when `train`; under jit with the batch sharded over devices that mean is the global one."""
        if self.conditional:
            z = jnp.concatenate([z, jax.nn.one_hot(labels, NUM_CLASSES)], axis=-1)
        h = self.project(z)  # (B, 16 * width)
        h = jax.nn.relu(self.project_norm(h, use_running_average=not train))
        h = h.reshape(h.shape[0], 4, 4, self.width)  # (B, 4, 4, width)
        for up, norm in zip(self.ups, self.norms):
            h = jax.nn.relu(norm(up(h), use_running_average=not train))  # (B, 2H, 2W, C/2)
        return jnp.tanh(self.to_image(h))


class Discriminator(nnx.Module):
    def __init__(self, cfg: ModelConfig, size: int, channels: int, *, conditional: bool, rngs: nnx.Rngs):
        self.conditional = conditional
        n_down = num_upsamples(size)
        width = cfg.d_channels
        first = max(width // 2 ** n_down, 16)
        sn = cfg.spectral_norm
        self.stem = SpectralConv(channels, first, (3, 3), 1, spectral=sn, rngs=rngs)
        downs, c = [], first
        for i in range(n_down):
            out = max(width // 2 ** (n_down - i - 1), 16)
            downs.append(SpectralConv(c, out, (4, 4), 2, spectral=sn, rngs=rngs))
            c = out
        self.downs = nnx.List(downs)
        self.features = 4 * 4 * c
        self.head = SpectralConv(self.features, 1, (1, 1), 1, spectral=sn, rngs=rngs)
        if conditional:
            self.embed = nnx.Embed(NUM_CLASSES, self.features, rngs=rngs)

    def __call__(self, x: jax.Array, labels: jax.Array | None = None, *, train: bool) -> jax.Array:
        """images (B, size, size, C) [labels (B,)] -> logits (B,)."""
        h = jax.nn.leaky_relu(self.stem(x, train=train), 0.2)
        for down in self.downs:
            h = jax.nn.leaky_relu(down(h, train=train), 0.2)  # (B, H/2, W/2, 2C)
        h = h.reshape(h.shape[0], 1, 1, self.features)  # (B, 1, 1, 16 * C): the head is a 1x1 convolution
        logits = self.head(h, train=train)[:, 0, 0, 0]  # (B,)
        if self.conditional:
            logits = logits + jnp.sum(self.embed(labels) * h[:, 0, 0], axis=-1)  # projection discriminator
        return logits
