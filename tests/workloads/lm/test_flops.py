"""Our model-FLOPs formula against XLA's own count of the compiled forward + backward pass.

XLA computes attention scores for every (query, key) pair, the causally masked half included, while model
FLOPs count the causal half once; so XLA's count should equal our formula plus that masked half, up to the
elementwise work (norms, softmax, activations) that the formula leaves out: stated tolerance 5%.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from systolic import config as config_lib
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.flops import matmul_params, train_flops_per_token
from systolic.workloads.lm.model.transformer import Transformer


@pytest.mark.parametrize("family, extra", [("llama", ["model.kv_heads=2"]), ("gpt2", ["model.tie_embeddings=true"])])
def test_formula_matches_xla_cost_analysis(family, extra):
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [
        f"model.family={family}", "model.d_model=128", "model.layers=2", "model.heads=4", "model.max_seq_len=128",
        "data.seq_len=128", *extra])).model
    vocab, batch, seq = 320, 4, 128
    graphdef, params = nnx.split(Transformer(cfg, vocab, rngs=nnx.Rngs(0)), nnx.Param)

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens)  # (B, T, V)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    tokens = jnp.zeros((batch, seq), jnp.int32)
    analysis = jax.jit(jax.grad(loss)).lower(nnx.to_pure_dict(params), tokens).compile().cost_analysis()
    xla_flops = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    ours = batch * seq * train_flops_per_token(cfg, vocab, seq)
    masked_half = batch * seq * 6 * cfg.layers * seq * cfg.heads * cfg.d_head
    assert xla_flops == pytest.approx(ours + masked_half, rel=0.05)
    assert xla_flops > ours  # the formula never inflates beyond what the hardware does


def test_a_sliding_window_counts_only_the_keys_in_it():
    """A query sees min(position + 1, W) keys: on average W - W^2 / (2T) of them (T/2 without a window)."""
    from systolic.workloads.lm.model.config import ModelConfig

    cfg = ModelConfig(d_model=64, layers=2, heads=4)
    windowed = ModelConfig(d_model=64, layers=2, heads=4, sliding_window=64)
    attention = lambda c, t: train_flops_per_token(c, 320, t) - 6 * matmul_params(c, 320)  # noqa: E731
    assert attention(windowed, 64) == attention(cfg, 64) == 12 * 2 * 32 * 4 * 16  # a window >= T changes nothing
    assert attention(windowed, 256) == 12 * 2 * (64 - 64**2 / 512) * 4 * 16  # 56 keys per query, not 128


@pytest.mark.parametrize("tiles", [True, False], ids=["cpu-tiles", "ragged_dot"])
def test_moe_counts_the_active_experts(tiles, monkeypatch):
    """A mixture of 4 experts, 2 per token, plus a shared expert, in one of two layers, against XLA's count. XLA
    computes more than the active experts, by a known amount: on CPU the tiled grouped matmul (lm/model/cpu.py) pads each
    expert's rows to whole tiles and computes every tile, and XLA:CPU's own ragged_dot (the CPU rewrite off) computes
    one matmul per expert over all rows, E times the work. Expected: formula + masked attention half + the routed
    experts' active FLOPs x (rows computed / rows routed - 1)."""
    from systolic.runtime import cpu_settings
    from systolic.workloads.lm.model import cpu
    from systolic.workloads.lm.model.flops import moe_active_params

    monkeypatch.setattr(cpu_settings, "settings", lambda: cpu_settings.CpuTuning(grouped=tiles))
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [
        "model.d_model=128", "model.layers=2", "model.heads=4", "model.max_seq_len=128", "data.seq_len=128",
        "model.moe.experts=4", "model.moe.top_k=2", "model.moe.mlp_dim=256", "model.moe.shared_experts=1",
        "model.moe.every=2", "model.dtype=float32"])).model
    vocab, batch, seq = 320, 4, 128
    graphdef, params = nnx.split(Transformer(cfg, vocab, rngs=nnx.Rngs(0)), nnx.Param)

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens)  # (B, T, V)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    tokens = jnp.zeros((batch, seq), jnp.int32)
    analysis = jax.jit(jax.grad(loss)).lower(nnx.to_pure_dict(params), tokens).compile().cost_analysis()
    xla_flops = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    ours = batch * seq * train_flops_per_token(cfg, vocab, seq)
    masked_half = batch * seq * 6 * cfg.layers * seq * cfg.heads * cfg.d_head
    rows = batch * seq * cfg.moe.top_k  # routed rows of the MoE layer
    routed = 6 * rows * 3 * cfg.d_model * cfg.d_expert  # their active FLOPs, forward + backward
    layout = cpu.tile_layout(jnp.zeros(cfg.moe.experts, jnp.int32), rows)
    computed = layout.group.shape[0] * layout.size if tiles else cfg.moe.experts * rows
    assert xla_flops == pytest.approx(ours + masked_half + (computed / rows - 1) * routed, rel=0.05)
    # Active, not total: 2 of 4 routed experts, the shared one, the router (128 x 4).
    assert moe_active_params(cfg) == 128 * 4 + 2 * 3 * 128 * 256 + 3 * 128 * 256
    dense_layer = 3 * 128 * cfg.d_mlp
    attention = 4 * 128 * 128
    assert matmul_params(cfg, vocab) == 2 * attention + dense_layer + moe_active_params(cfg) + 128 * vocab
