import jax
import pytest

from systolic.config import MeshConfig
from systolic.errors import ConfigError
from systolic.runtime import mesh as mesh_lib


def test_rest_axis_takes_remaining_devices():
    assert mesh_lib.resolve_shape(MeshConfig(data=-1, fsdp=2, tensor=1), 8) == (4, 1, 2, 1, 1, 1)
    assert mesh_lib.resolve_shape(MeshConfig(data=-1, expert=4), 8) == (2, 1, 1, 4, 1, 1)
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert mesh_lib.describe(mesh) == "data=2 x fsdp=2 x tensor=2"  # stage, expert and context are named when split
    # The context axis splits sequences, not the batch: its devices hold parts of the same rows.
    mesh = mesh_lib.make_mesh(MeshConfig(data=-1, context=4))
    assert mesh_lib.describe(mesh) == "data=2 x fsdp=1 x context=4 x tensor=1"
    assert mesh_lib.data_parallel_size(mesh) == 2
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("cfg", [MeshConfig(data=3), MeshConfig(data=-1, fsdp=3), MeshConfig(data=2, fsdp=2)])
def test_mesh_that_does_not_fit_names_device_count(cfg):
    with pytest.raises(ConfigError, match="8 available device"):
        mesh_lib.make_mesh(cfg)


def test_batch_must_divide_data_axes():
    mesh = mesh_lib.make_mesh(MeshConfig(data=4, fsdp=2))
    mesh_lib.check_batch(16, 2, mesh)
    with pytest.raises(ConfigError, match="multiple of 8, e.g. train.batch_size=16"):
        mesh_lib.check_batch(12, 1, mesh)
    # The expert axis holds different examples too (outside the MoE layers it is data parallel).
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, expert=4))
    assert mesh_lib.data_parallel_size(mesh) == 8 and mesh_lib.describe(mesh) == "data=2 x fsdp=1 x expert=4 x tensor=1"
    with pytest.raises(ConfigError, match="8 data-parallel devices of mesh data=2 x fsdp=1 x expert=4"):
        mesh_lib.check_batch(4, 1, mesh)


def test_slices_need_devices_that_span_them():
    # One process of 8 CPU devices is one slice: mesh.slices=2 says what it needs instead of building a wrong mesh.
    with pytest.raises(ConfigError, match="mesh.slices=2 splits the data axis across 2 processes.*span 1"):
        mesh_lib.make_mesh(MeshConfig(data=-1, slices=2))


def test_a_mesh_larger_than_the_cpu_says_how_to_try_it_on_fake_devices():
    with pytest.raises(ConfigError) as e:
        mesh_lib.resolve_shape(MeshConfig(fsdp=2, tensor=2), 1, cpu=True)
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in str(e.value)
    with pytest.raises(ConfigError) as e:  # accelerators: more devices are hardware, not a flag
        mesh_lib.resolve_shape(MeshConfig(fsdp=2), 1)
    assert "XLA_FLAGS" not in str(e.value)
