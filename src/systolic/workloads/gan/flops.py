"""Model FLOPs of one gan train step (the MFU numerator), counted from the networks' layer shapes.

A layer's forward pass counts 2 FLOPs per multiply-add with a real input value (a convolution's taps on SAME
padding or on a transposed convolution's dilation zeros are no work, as lm counts only the unmasked half of causal
attention); its backward pass costs the forward again per gradient it needs, weights and input. What train.py's
step computes, with B = train.batch_size:

    gan.d_steps x (G forward on B noise rows
                   + D on the 2B real and fake rows: forward, weight gradients, input gradients but the stem's)
    + G forward + D forward on B rows + D's input gradients (D's weights are held fixed in G's update)
    + G's weight gradients and input gradients but the projection's (noise needs no gradient)

Not counted: element-wise work (BatchNorm, activations, losses, optimizers, the EMA), the spectral norm's power
iteration and a conditional discriminator's projection; XLA counts them, so its figure is a few percent above this
one (tests/workloads/gan/test_flops.py). What each exclusion costs: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from systolic.workloads.gan.config import GANConfig
from systolic.workloads.gan.model import Discriminator, Generator


def taps(n: int, k: int, *, outputs: int, pad_lo: int, stride: int = 1, dilation: int = 1) -> int:
    """Along one axis of a convolution: the pairs (output pixel, kernel tap) that meet an input pixel, when the n
    input pixels stand `dilation` apart (a transposed convolution's input) after `pad_lo` zeros."""
    hits = 0
    for o in range(outputs):
        for t in range(k):
            p = o * stride + t - pad_lo  # the tap's position on the dilated input
            hits += p >= 0 and p % dilation == 0 and p // dilation < n
    return hits


def conv_flops(conv: nnx.Conv, n: int) -> int:
    """Forward FLOPs per image of a SAME, square `conv` on an n x n input."""
    kh, kw, c_in, c_out = conv.kernel.shape
    s = conv.strides if isinstance(conv.strides, int) else conv.strides[0]
    (lo, _), _ = jax.lax.padtype_to_pads((n, n), (kh, kw), (s, s), "SAME")
    return 2 * c_in * c_out * taps(n, kh, outputs=-(-n // s), pad_lo=lo, stride=s) ** 2


def conv_transpose_flops(conv: nnx.ConvTranspose, n: int) -> int:
    """Forward FLOPs per image of a SAME, square, stride-s `conv` on an n x n input (n*s x n*s output)."""
    k, _, c_in, c_out = conv.kernel.shape
    s = conv.strides[0]
    # The padding jax.lax.conv_transpose puts around the dilated input for padding="SAME".
    pad_lo = k - 1 if s > k - 1 else -(-(k + s - 2) // 2)
    return 2 * c_in * c_out * taps(n, k, outputs=n * s, pad_lo=pad_lo, dilation=s) ** 2


def generator_flops(g: Generator, size: int) -> list[int]:
    """Forward FLOPs per generated image of each layer, input to output: [projection, upsamplings..., to_image]."""
    ups = [conv_transpose_flops(up, 4 * 2**i) for i, up in enumerate(g.ups)]  # from the 4x4 map, doubling
    return [2 * math.prod(g.project.kernel.shape), *ups, conv_flops(g.to_image, size)]


def discriminator_flops(d: Discriminator, size: int) -> list[int]:
    """Forward FLOPs per scored image of each layer, input to output: [stem, downsamplings..., head]."""
    downs = [conv_flops(down.conv, size // 2**i) for i, down in enumerate(d.downs)]  # halving to 4x4
    return [conv_flops(d.stem.conv, size), *downs, 2 * math.prod(d.head.conv.kernel.shape)]


def train_flops_per_step(cfg: GANConfig, channels: int) -> int:
    """Model FLOPs of one train step of `cfg` on images of `channels` channels (see the module's docstring)."""
    from systolic.workloads.gan.train import make_models  # train.py builds the step; this module only reads shapes

    g, d = nnx.eval_shape(lambda: make_models(cfg, channels, jax.random.PRNGKey(0)))  # shapes: nothing allocated
    g_layers, d_layers = generator_flops(g, cfg.image.size), discriminator_flops(d, cfg.image.size)
    fg, fd, rows = sum(g_layers), sum(d_layers), cfg.train.batch_size
    d_update = rows * fg + 2 * rows * (3 * fd - d_layers[0])  # (2B rows: real and fake in one pass)
    g_update = rows * (fg + 2 * fd) + rows * (2 * fg - g_layers[0])
    return cfg.gan.d_steps * d_update + g_update
