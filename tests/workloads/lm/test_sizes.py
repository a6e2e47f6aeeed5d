"""lm/model/sizes.py: the parameter count from the config alone is a tight lower bound on the model's real one."""

import dataclasses

import pytest

from tiny_files import TINY_MODEL

from systolic.engine.state import param_count
from systolic.workloads.lm.model import sizes
from systolic.workloads.lm.model.sections import LoraConfig, MoeConfig
from systolic.workloads.lm.hf.convert import abstract_params


@pytest.mark.parametrize("changes", [
    {}, {"family": "gpt2"}, {"tie_embeddings": True}, {"qkv_bias": True, "qk_norm": True},
    {"moe": MoeConfig(experts=4, top_k=2, mlp_dim=32, shared_experts=1)},
    {"lora": LoraConfig(rank=4, targets="all")},
])
def test_param_count_is_a_tight_lower_bound(changes):
    cfg = dataclasses.replace(TINY_MODEL, **changes)
    actual = param_count(abstract_params(cfg, 320))
    estimate = sizes.param_count(cfg, 320)
    assert 0.97 * actual <= estimate <= actual  # norms and biases are left out
