"""Network shapes for every image size, and the spectral normalisation's singular-value estimate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from systolic.workloads.gan.config import IMAGE_SIZES, ModelConfig
from systolic.workloads.gan.model import Discriminator, Generator, SpectralConv


@pytest.mark.parametrize("size", IMAGE_SIZES)
@pytest.mark.parametrize("conditional,spectral", [(False, False), (True, True)])
def test_shapes_for_each_image_size(size, conditional, spectral):
    cfg = ModelConfig(latent_dim=8, g_channels=32, d_channels=32, spectral_norm=spectral)

    def forward():
        g = Generator(cfg, size, 3, conditional=conditional, rngs=nnx.Rngs(0))
        d = Discriminator(cfg, size, 3, conditional=conditional, rngs=nnx.Rngs(1))
        labels = jnp.array([3, 7])
        images = g(jnp.ones((2, 8)), labels, train=True)
        return images, d(images, labels, train=True)

    images, logits = jax.eval_shape(forward)  # shapes only: tracing, no compilation
    assert images.shape == (2, size, size, 3)
    assert logits.shape == (2,)


def test_spectral_norm_converges_to_the_largest_singular_value():
    conv = SpectralConv(4, 6, (3, 3), 1, spectral=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 5, 5, 4))
    call = nnx.jit(lambda conv, x: conv(x, train=True))
    for _ in range(50):  # power iteration, one step per training call
        call(conv, x)
    w = np.asarray(conv.conv.kernel[...]).reshape(-1, 6)
    sigma = np.linalg.svd(w, compute_uv=False)[0]
    u = conv.u[...]
    estimate = float(np.linalg.norm(w @ np.asarray(u)))  # ||W u|| with u the top right-singular vector
    np.testing.assert_allclose(estimate, sigma, rtol=1e-4)
