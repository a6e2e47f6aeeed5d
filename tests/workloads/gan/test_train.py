"""The gan step: 8 devices compute what 1 device computes; a resumed run continues identically."""

import jax
import numpy as np
import pytest
from tiny import run_steps

from systolic.config import MeshConfig
from systolic.engine import loop
from systolic.errors import ConfigError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate
from systolic.workloads.gan.task import build_task


@pytest.mark.parametrize("extra", [(), pytest.param(("gan.loss=hinge", "gan.d_steps=2", "model.spectral_norm=true",
                                                     "gan.conditional=true"), marks=pytest.mark.slow)])
def test_eight_devices_equal_one_device(make_cfg, extra):
    cfg = make_cfg(*extra)
    one = mesh_lib.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    eight = mesh_lib.make_mesh(MeshConfig(data=8))
    prepared1, prepared8 = build_task(cfg, one, None), build_task(cfg, eight, None)
    s1, m1 = run_steps(prepared1.task, 2, mesh=one, rules=prepared1.rules)
    s8, m8 = run_steps(prepared8.task, 2, mesh=eight, rules=prepared8.rules)
    task8 = prepared8.task
    assert task8.train_step._cache_size() == 1  # explicit shardings: no recompile on step 2
    for a, b in zip(m1, m8):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=2e-5)
        np.testing.assert_allclose(a["d_loss"], b["d_loss"], rtol=2e-5)
    # BatchNorm statistics are those of the global batch on both meshes, so everything agrees.
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), s1, s8)


def test_resume_continues_identically(make_cfg, tmp_path):
    cfg = make_cfg()
    mesh = mesh_lib.make_mesh(MeshConfig(data=2), jax.devices()[:2])

    def train(cfg, run_dir):
        prepared = build_task(cfg, mesh, None)
        settings = loop.LoopSettings(steps=cfg.train.steps, eval_every=cfg.train.eval_every, loop=cfg.loop,
                                     checkpoint=cfg.checkpoint, observe=cfg.observe, quiet=True)
        with activate(mesh, prepared.rules):
            return loop.train(prepared.task, settings, run_dir)

    straight = train(cfg, tmp_path / "straight")
    first = train(make_cfg("loop.stop_at_step=2"), tmp_path / "resumed")
    assert first.final_step == 2
    resumed = train(cfg, tmp_path / "resumed")
    assert resumed.start_step == 2 and resumed.final_step == 4
    a, b, c = (jax.device_get(r.state) for r in (straight, resumed, first))
    assert not np.allclose(a.params["g"]["to_image"]["kernel"], c.params["g"]["to_image"]["kernel"])  # it trained
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_conditional_folder_is_a_config_error(make_cfg):
    with pytest.raises(ConfigError, match="needs class labels"):
        make_cfg("gan.conditional=true", "data.path=/tmp")


def test_unsupported_image_size_is_a_config_error(make_cfg):
    with pytest.raises(ConfigError, match="image.size=12"):
        make_cfg("image.size=12")
