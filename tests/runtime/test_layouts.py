"""Each parallelism layout: the loss equals the single-device loss and parameters are split as the rules say."""

import numpy as np
import pytest

from systolic.config import MeshConfig
from systolic.data.tokenizer import make_tokenizer
from systolic.errors import ConfigError
from systolic.runtime import mesh as mesh_lib
from systolic.workloads.lm.train import build_task

LAYOUTS = {
    # name: (mesh, rules, expected spec of the MLP's w_up (embed, mlp) and of wq (embed, heads, head_dim))
    "data": (MeshConfig(data=8), "dp", ((None, None), (None, None, None))),
    "fsdp": (MeshConfig(data=1, fsdp=8), "fsdp", (("fsdp", None), ("fsdp", None, None))),
    "tensor": (MeshConfig(data=2, tensor=4), "tp", ((None, "tensor"), (None, "tensor", None))),
    "fsdp+tensor": (MeshConfig(data=1, fsdp=4, tensor=2), "default", (("fsdp", "tensor"), ("fsdp", "tensor", None))),
}


@pytest.fixture(scope="module")
def single_device_losses(tiny_lm):
    cfg = tiny_lm.make_cfg("model.heads=8", "model.kv_heads=4")
    return tiny_lm.run_steps(cfg, tiny_lm.single_device_mesh(), 2)[2]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_device_and_shards_params(tiny_lm, single_device_losses, layout):
    mesh_cfg, rules, (w_up_spec, wq_spec) = LAYOUTS[layout]
    cfg = tiny_lm.make_cfg("model.heads=8", "model.kv_heads=4", f"sharding.rules={rules}")
    mesh = mesh_lib.make_mesh(mesh_cfg)
    _, state, losses = tiny_lm.run_steps(cfg, mesh, 2)
    np.testing.assert_allclose(losses, single_device_losses, rtol=2e-5)
    block = state.params["blocks"][0]
    assert tuple(block["mlp"]["w_up"].sharding.spec) == w_up_spec
    assert tuple(block["attn"]["wq"].sharding.spec) == wq_spec
    if layout != "data":  # a sharded parameter really is split: each device holds a fraction
        w = block["mlp"]["w_up"]
        assert w.addressable_shards[0].data.size < w.size


def test_axis_that_does_not_divide_a_dimension_is_named(tiny_lm):
    cfg = tiny_lm.make_cfg("model.heads=4", "model.kv_heads=2")  # kv_heads=2 cannot split 8 ways
    with pytest.raises(ConfigError, match=r"params\['blocks'\]\[0\]\['attn'\]\['wk'\] has size 2 in dimension 1.*tensor = 8"):
        build_task(cfg, mesh_lib.make_mesh(MeshConfig(data=1, tensor=8)), make_tokenizer(cfg.data.tokenizer))


def test_rules_that_leave_a_mesh_axis_idle_are_rejected(tiny_lm):
    cfg = tiny_lm.make_cfg("sharding.rules=fsdp")
    with pytest.raises(ConfigError, match="does not use the mesh axis tensor"):
        build_task(cfg, mesh_lib.make_mesh(MeshConfig(data=4, tensor=2)), make_tokenizer(cfg.data.tokenizer))
