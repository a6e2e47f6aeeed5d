"""Expert parallelism (mesh.expert, lm/model/moe.py): the MoE model trains to the same losses on one device and on meshes
that split its 8 experts over the `expert` axis together with data, fsdp and tensor; the compiled step moves tokens
with all-to-all and gathers only each device's own experts."""

import re

import jax
import numpy as np
import pytest

from systolic.data.tokenizer import make_tokenizer
from systolic.plan import hlo_collectives
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate
from systolic.workloads.lm.train import abstract_batch, build_step
from tiny import MOE

EXPERTS = ["model.moe.experts=8"]  # one expert per device at mesh.expert=8


def losses(tiny_lm, extra: list[str], mesh_axes: dict[str, int] | None) -> list[float]:
    axes = mesh_axes or {"data": 1}
    cfg = tiny_lm.make_cfg(*MOE, *EXPERTS, *extra, *(f"mesh.{a}={n}" for a, n in axes.items()))
    mesh = tiny_lm.single_device_mesh() if mesh_axes is None else mesh_lib.make_mesh(cfg.mesh)
    return tiny_lm.run_steps(cfg, mesh, 3)[2]


@pytest.mark.parametrize("extra, meshes", [
    ([], [{"expert": 8}, {"data": 2, "expert": 4}, {"fsdp": 2, "expert": 4}]),  # dropless: sort, grouped matmul
    # Capacity (dense) dispatch with a shared expert; the experts' hidden axis split over tensor too.
    pytest.param(["model.moe.capacity_factor=1", "model.moe.shared_experts=1"], [{"fsdp": 2, "expert": 2, "tensor": 2}],
                 marks=pytest.mark.slow),
])
def test_same_losses_on_one_device_and_expert_parallel_meshes(tiny_lm, extra, meshes):
    one = losses(tiny_lm, extra, None)
    for axes in meshes:
        np.testing.assert_allclose(losses(tiny_lm, extra, {"data": 1, **axes}), one, rtol=2e-6, err_msg=str(axes))
    assert one[-1] < one[0]


def test_compiled_step_moves_tokens_with_all_to_all_and_gathers_only_local_experts(tiny_lm):
    """On fsdp=2 x expert=4 each device holds 2 of the 8 experts (each half of its embed axis): ZeRO-3 gathers
    those 2 over fsdp, (2, 32, 32); the experts of other devices are never gathered, (8, 32, 32); their tokens
    come and go by all-to-all."""
    cfg = tiny_lm.make_cfg(*MOE, *EXPERTS, "mesh.data=1", "mesh.fsdp=2", "mesh.expert=4")
    mesh = mesh_lib.make_mesh(cfg.mesh)
    step = build_step(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    with activate(mesh, step.rules):
        hlo = step.train_step.lower(step.abstract, abstract_batch(cfg, step.batch_sharding)).compile().as_text()
    gathered = re.findall(r"= (f32\[[0-9,]*\])\S* all-gather\(", hlo)
    assert "f32[2,32,32]" in gathered  # this device's experts, gathered over fsdp
    assert not any(shape.startswith("f32[8,") for shape in gathered), gathered
    collectives = hlo_collectives.read_collectives(hlo)
    # Per MoE layer: dispatch and combine forward, their transposes backward (2 layers, rows and expert ids).
    assert collectives["all-to-all"].count >= 2 * 4 and collectives["all-to-all"].bytes > 0


def test_experts_must_split_evenly_over_the_expert_axis(tiny_lm):
    from systolic.errors import ConfigError

    cfg = tiny_lm.make_cfg(*MOE, "mesh.data=1", "mesh.expert=8")  # 4 experts over 8 devices
    with pytest.raises(ConfigError, match=r"\['mlp'\]\['w_\w+'\] has size 4 in dimension 0, which is split over mesh axis expert.*model.moe.experts"):
        build_step(cfg, mesh_lib.make_mesh(cfg.mesh), make_tokenizer(cfg.data.tokenizer))
    assert jax.device_count() == 8
