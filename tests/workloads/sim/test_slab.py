"""The slab-decomposed FFT against NumPy, on one device and split over 8, and its communication pattern."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.workloads.sim.slab import Slab

pytestmark = pytest.mark.usefixtures("x64")


@pytest.mark.parametrize("layout", ["1 device", "data=8", "2x2x2"])
def test_forward_and_inverse_match_numpy(layout, mesh_of):
    mesh = mesh_of(layout)
    n = 32
    slab = Slab(n, ("data", "fsdp", "tensor"), mesh.size)
    f = np.random.default_rng(0).normal(size=(3, n, n))  # a batch of fields, as the solver transforms 4 at once
    forward = jax.jit(jax.shard_map(slab.forward, mesh=mesh, in_specs=jax.P(None, *slab.physical_spec),
                                    out_specs=jax.P(None, *slab.spectral_spec)))
    inverse = jax.jit(jax.shard_map(slab.inverse, mesh=mesh, in_specs=jax.P(None, *slab.spectral_spec),
                                    out_specs=jax.P(None, *slab.physical_spec)))
    g = forward(jnp.asarray(f))
    expected = np.fft.rfft2(f)[..., : n // 2]  # the Nyquist column is dropped
    np.testing.assert_allclose(np.asarray(g), expected, rtol=0, atol=1e-11)
    # Inverse of a field without Nyquist content gives it back exactly.
    band_limited = np.fft.irfft2(np.concatenate([expected, np.zeros((3, n, 1))], axis=-1), s=(n, n))
    np.testing.assert_allclose(np.asarray(inverse(g)), band_limited, rtol=0, atol=1e-13)


def test_wavenumber_blocks_follow_the_sharding(mesh_of):
    mesh = mesh_of("2x2x2")
    slab = Slab(32, ("data", "fsdp", "tensor"), 8)
    ky = jax.jit(jax.shard_map(lambda: slab.wavenumber_indices()[1], mesh=mesh, in_specs=(),
                               out_specs=jax.P(None, slab.axes)))()
    np.testing.assert_array_equal(np.asarray(ky)[0], np.arange(16))
