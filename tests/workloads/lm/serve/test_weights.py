"""The weights as served (serve/weights.py): a bfloat16 model's weights stored in bfloat16 once, the float32 ones its
layers use in float32 kept, and the model's output unchanged to the bit, for the parameters each family adds (a
mixture of experts' router, attention sinks, biases, norms)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_serve import MOE, random_params, tiny_model

from systolic.workloads.lm.serve.weights import FLOAT32_PARAMS, serving_params

FAMILIES = {"gqa": [], "qwen": ["model.qk_norm=true", "model.qkv_bias=true"], "moe": MOE,
            "sinks": ["model.attn_sinks=true", "model.attn_out_bias=true"], "gpt2": ["model.family=gpt2"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_weights_give_the_float32_weights_outputs(family):
    cfg = tiny_model(*FAMILIES[family], "model.dtype=bfloat16")
    graphdef, params = random_params(cfg)
    served = serving_params(params, jnp.bfloat16)
    kept = []
    for (path, leaf), stored in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(served)):
        name = jax.tree_util.keystr(path)
        if any(word in name for word in FLOAT32_PARAMS):
            assert stored.dtype == jnp.float32, name
            kept.append(name)
        else:
            assert stored.dtype == jnp.bfloat16, name
    assert kept and sum(x.size for x in jax.tree.leaves(served) if x.dtype == jnp.float32) < 0.1 * sum(
        x.size for x in jax.tree.leaves(served))  # the norms and such: a sliver of the bytes
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    forward = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens))
    np.testing.assert_array_equal(np.asarray(forward(served)), np.asarray(forward(params)))


def test_a_float32_model_is_served_as_it_is():
    _, params = random_params(tiny_model())
    assert serving_params(params, jnp.float32) is params
