"""The pencil-decomposed 3-D FFT against NumPy on one device, on 2-D meshes and on both slabs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.errors import ConfigError
from systolic.workloads.sim.pencil import make_pencil

pytestmark = pytest.mark.usefixtures("x64")


@pytest.mark.parametrize("paired", [False, True], ids=["plain", "paired"])  # pair_real_transforms: the TPU's z passes
@pytest.mark.parametrize("layout", ["1 device", "2x2", "2x4", "data=8", "1x8"])
def test_forward_and_inverse_match_numpy(layout, paired, mesh_of):
    mesh = mesh_of(layout)
    n = 16
    pencil = dataclasses.replace(make_pencil(n, mesh), pair_real_transforms=paired)
    assert pencil.parts == mesh.size
    f = np.random.default_rng(0).normal(size=(2, n, n, n))  # a batch of fields, as the solver transforms 6 at once
    batched = lambda spec: jax.P(None, *spec)
    forward = jax.jit(jax.shard_map(pencil.forward, mesh=mesh, in_specs=batched(pencil.physical_spec),
                                    out_specs=batched(pencil.spectral_spec)))
    inverse = jax.jit(jax.shard_map(pencil.inverse, mesh=mesh, in_specs=batched(pencil.spectral_spec),
                                    out_specs=batched(pencil.physical_spec)))
    g = forward(jnp.asarray(f))
    expected = np.fft.rfftn(f, axes=(1, 2, 3))[..., : n // 2]  # the Nyquist plane kz = n/2 is dropped
    np.testing.assert_allclose(np.asarray(g), expected, rtol=0, atol=1e-11)
    # Inverse of a field without Nyquist content gives it back exactly.
    band_limited = np.fft.irfftn(np.concatenate([expected, np.zeros((2, n, n, 1))], axis=-1), s=(n, n, n),
                                 axes=(1, 2, 3))
    np.testing.assert_allclose(np.asarray(inverse(g)), band_limited, rtol=0, atol=1e-13)


def test_wavenumber_and_grid_blocks_follow_the_sharding(mesh_of):
    mesh = mesh_of("2x4")
    pencil = make_pencil(16, mesh)
    assert (pencil.row_axes, pencil.col_axes, pencil.rows, pencil.cols) == (("data",), ("fsdp",), 2, 4)
    spectral = jax.jit(jax.shard_map(lambda: [jnp.broadcast_to(k, (16, 8, 2)) for k in pencil.wavenumber_indices()],
                                     mesh=mesh, in_specs=(), out_specs=pencil.spectral_spec))()
    kx, ky, kz = (np.asarray(k) for k in spectral)
    freqs = np.fft.fftfreq(16, 1 / 16)
    np.testing.assert_array_equal(kx[:, 0, 0], freqs)
    np.testing.assert_array_equal(ky[0, :, 0], freqs)
    np.testing.assert_array_equal(kz[0, 0, :], np.arange(8))
    physical = jax.jit(jax.shard_map(lambda: [jnp.broadcast_to(i, (8, 4, 16)) for i in pencil.physical_indices()],
                                     mesh=mesh, in_specs=(), out_specs=pencil.physical_spec))()
    for axis, index in enumerate(physical):
        np.testing.assert_array_equal(np.moveaxis(np.asarray(index), axis, 0)[:, 0, 0], np.arange(16))


def test_a_grid_that_does_not_split_is_refused_with_a_fix(mesh_of):
    with pytest.raises(ConfigError, match=r"grid.n=12 cannot be split into 2 x 4 pencils.*grid.n=16"):
        make_pencil(12, mesh_of("2x4"))
