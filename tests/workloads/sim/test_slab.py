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


@pytest.mark.parametrize("layout", ["1 device", "data=8", "2x2x2"])
def test_paired_real_transforms_equal_the_plain_ones(layout, mesh_of):
    """The TPU's y passes (`pair_real_transforms`: two real fields in one complex inverse, a real row as a complex
    half-length one forward) give the plain transforms' results to round-off, for an even batch (paired) and an odd
    one (the inverse falls back to `irfft`)."""
    mesh = mesh_of(layout)
    n = 32
    plain = Slab(n, ("data", "fsdp", "tensor"), mesh.size)
    paired = Slab(n, ("data", "fsdp", "tensor"), mesh.size, pair_real_transforms=True)
    f = jnp.asarray(np.random.default_rng(1).normal(size=(4, n, n)))

    def both(slab):
        forward = jax.shard_map(slab.forward, mesh=mesh, in_specs=jax.P(None, *slab.physical_spec),
                                out_specs=jax.P(None, *slab.spectral_spec))
        inverse = jax.shard_map(slab.inverse, mesh=mesh, in_specs=jax.P(None, *slab.spectral_spec),
                                out_specs=jax.P(None, *slab.physical_spec))
        g = jax.jit(forward)(f)
        return g, jax.jit(inverse)(g), jax.jit(inverse)(g[:3])

    for want, got in zip(both(plain), both(paired), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-11)


def test_wavenumber_blocks_follow_the_sharding(mesh_of):
    mesh = mesh_of("2x2x2")
    slab = Slab(32, ("data", "fsdp", "tensor"), 8)
    ky = jax.jit(jax.shard_map(lambda: slab.wavenumber_indices()[1], mesh=mesh, in_specs=(),
                               out_specs=jax.P(None, slab.axes)))()
    np.testing.assert_array_equal(np.asarray(ky)[0], np.arange(16))


@pytest.mark.tpu_aot
def test_on_a_tpu_the_solver_pairs_its_transforms_for_a_third_fewer_flops():
    """make_slab turns the pairing on for TPU devices only; the TPU compiler's cost analysis of one solver stage
    (four fields back, their product forward) at 256^2 then counts 0.49 GFLOP against 0.73 (libtpu 0.0.42.1), since
    XLA's TPU real transforms cost full complex ones."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    from systolic import config as config_lib
    from systolic.config import MeshConfig
    from systolic.runtime.mesh import make_mesh
    from systolic.workloads.sim.config import SimConfig
    from systolic.workloads.sim.solver import make_slab

    n = 256
    cfg = config_lib.from_dict(SimConfig, config_lib.apply_overrides({}, [f"grid.n={n}"]))
    tpu = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    assert not make_slab(cfg, make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])).pair_real_transforms
    slab = make_slab(cfg, make_mesh(MeshConfig(data=1), devices=[tpu]))
    assert slab.pair_real_transforms

    def flops(slab):
        def stage(g):
            u = slab.inverse(g)
            return slab.forward(u[0] * u[2] + u[1] * u[3])

        spectra = jax.ShapeDtypeStruct((4, n, n // 2), jnp.complex64, sharding=jax.sharding.SingleDeviceSharding(tpu))
        analysis = jax.jit(stage).lower(spectra).compile().cost_analysis()
        return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

    ratio = flops(slab) / flops(Slab(n))
    assert ratio < 0.7, ratio
