"""The mixture-of-experts MLP (model.moe, lm/model/moe.py) against a float64 NumPy loop over each token's selected experts,
both dispatches (dropless grouped matmul, capacity one-hot einsums) and their gradients, the router's losses, and
a short training run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from systolic import config as config_lib
from systolic.errors import ConfigError
from systolic.workloads.lm.model import moe as moe_lib
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.sublayers import MoE
from tiny import MOE, TINY_MOE

B, T = 2, 8


def model_cfg(*extra: str):
    return config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [*TINY_MOE, *extra])).model


def make_layer(*extra: str) -> tuple[MoE, jax.Array]:
    """A MoE layer with weights of std 0.3 (routing far from ties, so float32 and float64 pick the same experts)
    and its input (B, T, D)."""
    cfg = model_cfg("model.init_std=0.3", "model.dtype=float32", *extra)
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, cfg.d_model), jnp.float32)
    return layer, x


def reference(layer: MoE, x: np.ndarray, slots: int | None = None) -> tuple[np.ndarray, float]:
    """A float64 loop: each token's top-k experts by router probability, mixed by the (renormalised) probabilities;
    with `slots`, each sequence's experts take assignments first choice first, in token order, up to `slots`."""
    p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(layer, nnx.Param)).items()
         if not isinstance(v, dict)}
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    x = np.asarray(x, np.float64)
    k = layer.top_k
    y = np.zeros_like(x)
    dropped = 0
    for b in range(x.shape[0]):
        logits = x[b] @ p["router"]  # (T, E)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1)[:, :k]  # (T, k)
        weights = np.take_along_axis(probs, top, -1)
        if layer.norm_topk_prob:
            weights /= weights.sum(-1, keepdims=True)
        kept = np.ones(top.shape, bool)
        if slots is not None:
            used = np.zeros(probs.shape[-1], int)
            for j in range(k):
                for t in range(x.shape[1]):
                    kept[t, j] = used[top[t, j]] < slots
                    used[top[t, j]] += kept[t, j]
        for t in range(x.shape[1]):
            for j in range(k):
                if not kept[t, j]:
                    dropped += 1
                    continue
                e = top[t, j]
                h = silu(x[b, t] @ p["w_gate"][e]) * (x[b, t] @ p["w_up"][e])
                y[b, t] += weights[t, j] * (h @ p["w_down"][e])
    if layer.shared is not None:
        s = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(layer.shared, nnx.Param)).items()}
        shared = (silu(x @ s["w_gate"]) * (x @ s["w_up"])) @ s["w_down"]
        if layer.shared_gate is not None:
            shared *= 1 / (1 + np.exp(-(x @ np.asarray(layer.shared_gate[...], np.float64))))
        y += shared
    return y, dropped / (x.shape[0] * x.shape[1] * k)


@pytest.mark.parametrize("extra", [
    [],  # Mixtral: 4 experts, top 2, renormalised
    ["model.moe.norm_topk_prob=false", "model.moe.top_k=3"],  # Qwen-MoE's raw probabilities
    ["model.moe.shared_experts=1", "model.moe.shared_gate=true", "model.moe.norm_topk_prob=false"],  # Qwen2-MoE
    ["model.moe.top_k=1", "model.moe.shared_experts=2"],  # Switch, plus DeepSeek-style ungated shared experts
])
def test_dropless_layer_equals_a_per_token_loop(extra):
    layer, x = make_layer(*extra)
    y, stats = layer(x)
    want, _ = reference(layer, x)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=2e-5, rtol=1e-4)
    assert float(stats.dropped) == 0.0


def test_capacity_dispatch_drops_as_the_loop_does():
    """Capacity 0.5 x an even share: each of the 4 experts takes ceil(0.5 * 8 * 2 / 4) = 2 of a sequence's 16
    assignments, so half or more are dropped, first choices kept first."""
    layer, x = make_layer("model.moe.capacity_factor=0.5")
    y, stats = layer(x)
    want, dropped = reference(layer, x, slots=2)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=2e-5, rtol=1e-4)
    assert float(stats.dropped) == pytest.approx(dropped) and dropped >= 0.5


def test_capacity_with_room_for_every_token_equals_dropless_with_gradients():
    """Capacity factor E / k gives each expert T slots: nothing drops, so both dispatches compute the same function;
    their gradients (with respect to every weight and the input) must agree."""
    dropless, x = make_layer("model.moe.shared_experts=1", "model.moe.shared_gate=true")
    dense, _ = make_layer("model.moe.shared_experts=1", "model.moe.shared_gate=true", "model.moe.capacity_factor=2")
    graphdef_a, params = nnx.split(dropless, nnx.Param)
    graphdef_b, _ = nnx.split(dense, nnx.Param)
    probe = jax.random.normal(jax.random.PRNGKey(2), x.shape, jnp.float32)

    def loss(graphdef):
        def f(params, x):
            y, stats = nnx.merge(graphdef, params)(x)
            return jnp.sum(y * probe) + stats.aux_loss + stats.z_loss  # the router's losses have gradients too
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    (va, ga), (vb, gb) = loss(graphdef_a)(params, x), loss(graphdef_b)(params, x)
    assert float(va) == pytest.approx(float(vb), rel=1e-5)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert float(jnp.abs(ga[0]["router"][...]).max()) > 0  # the router learns through the mixing weights


def test_gradient_matches_finite_differences():
    """The dropless layer's directional derivative along a random direction of the expert and router weights, against
    central differences (the step is small enough that no token changes experts)."""
    layer, x = make_layer()
    graphdef, params = nnx.split(layer, nnx.Param)
    probe = jax.random.normal(jax.random.PRNGKey(2), x.shape, jnp.float32)
    f = jax.jit(lambda p: jnp.sum(nnx.merge(graphdef, p)(x)[0] * probe))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(3), len(leaves))
    direction = jax.tree.unflatten(treedef, [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)])
    grad = jax.grad(f)(params)
    analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(direction)))
    eps = 1e-3
    shifted = lambda s: jax.tree.map(lambda p, d: p + s * eps * d, params, direction)  # noqa: E731
    numeric = (float(f(shifted(1.0))) - float(f(shifted(-1.0)))) / (2 * eps)
    assert analytic == pytest.approx(numeric, rel=2e-2)


def test_router_losses_and_load():
    """Switch's load-balancing loss E * sum_e f_e P_e and the z-loss mean(logsumexp^2), from a routing by hand."""
    logits = jnp.array([[2.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.5]], jnp.float32)
    experts = jnp.array([[0, 1], [1, 0], [2, 3]], jnp.int32)
    stats = moe_lib.router_stats(moe_lib.Routing(experts, jnp.ones((3, 2), jnp.float32), logits), jnp.zeros(()))
    probs = np.exp(np.asarray(logits, np.float64))
    probs /= probs.sum(-1, keepdims=True)
    f = np.array([2, 2, 1, 1]) / 6
    assert float(stats.aux_loss) == pytest.approx(4 * np.sum(f * probs.mean(0)), rel=1e-6)
    z = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    assert float(stats.z_loss) == pytest.approx(np.mean(z**2), rel=1e-6)
    np.testing.assert_allclose(stats.load, f, rtol=1e-6)
    m = moe_lib.metrics(jax.tree.map(lambda a: a[None], stats), capacity=False)
    assert float(m["moe/load_max_over_mean"]) == pytest.approx(4 * 2 / 6)
    assert float(m["moe/load_min_over_mean"]) == pytest.approx(4 * 1 / 6)


def test_which_layers_are_moe():
    assert model_cfg("model.layers=4").moe_layers == (0, 1, 2, 3)
    assert model_cfg("model.layers=4", "model.moe.every=2").moe_layers == (1, 3)  # HF decoder_sparse_step
    assert model_cfg("model.layers=4", "model.moe.first=1").moe_layers == (1, 2, 3)  # DeepSeek's first dense layer


@pytest.mark.parametrize("override, message", [
    ("model.moe.top_k=5", r"1 <= top_k <= experts"),
    ("model.family=gpt2", r"SwiGLU MLPs of the llama block"),
    ("model.moe.first=2", r"no layer is a MoE layer"),
    ("model.moe.capacity_factor=-1", r"must be >= 0"),
    ("model.moe.shared_gate=true", r"model.moe.shared_experts=0"),
])
def test_bad_settings_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        model_cfg(override)
    with pytest.raises(ConfigError, match=r"stacks identical layers"):
        model_cfg("model.scan_layers=true", "model.moe.every=2")


@pytest.mark.parametrize("extra", [[], ["model.moe.capacity_factor=1"]])
def test_training_lowers_the_loss_and_reports_the_router(tiny_lm, extra):
    from tiny import run_steps

    from systolic.data.tokenizer import make_tokenizer
    from systolic.workloads.lm.train import build_task

    cfg = tiny_lm.make_cfg(*MOE, *extra)
    mesh = tiny_lm.single_device_mesh()
    prepared = build_task(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    _, metrics = run_steps(prepared.task, 4, mesh=mesh, rules=prepared.rules)
    assert float(metrics[-1]["loss"]) < float(metrics[0]["loss"])
    m = metrics[-1]
    assert {"moe/ce", "moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean", "moe/load_min_over_mean"} <= set(m)
    assert ("moe/dropped" in m) == bool(extra)
    # The loss trained on is the cross-entropy plus the weighted router losses.
    w = cfg.model.moe
    assert float(m["loss"]) == pytest.approx(float(m["moe/ce"]) + w.aux_loss_weight * float(m["moe/aux_loss"])
                                             + w.z_loss_weight * float(m["moe/z_loss"]), rel=1e-6)
    assert 1.0 <= float(m["moe/load_max_over_mean"]) <= 4.0 and 0.0 <= float(m["moe/load_min_over_mean"]) <= 1.0


@pytest.mark.parametrize("sizes", [[5, 0, 20, 3], [0, 0, 0, 0], [32, 0, 0, 0]])
def test_cpu_tiled_grouped_matmul_equals_ragged_dot(sizes):
    """lm/model/cpu.py's tiles (XLA:CPU's ragged_dot computes every group over every row) against ragged_dot, with empty
    groups and rows past the groups, forward and backward."""
    from systolic.workloads.lm.model import cpu

    group_sizes = jnp.array(sizes, jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 16), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 8), jnp.float32)

    def tiled(x, w):
        tiles = cpu.tile_layout(group_sizes, x.shape[0])
        return cpu.from_tiles(cpu.tiled_matmul(cpu.to_tiles(x, tiles), w, tiles), tiles)

    ragged = lambda x, w: jax.lax.ragged_dot(x, w, group_sizes)  # noqa: E731
    np.testing.assert_allclose(tiled(x, w), ragged(x, w), atol=1e-5)
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))  # noqa: E731
    for a, b in zip(jax.grad(loss(tiled), (0, 1))(x, w), jax.grad(loss(ragged), (0, 1))(x, w), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
