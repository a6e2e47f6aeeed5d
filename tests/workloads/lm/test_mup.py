"""muP (`model.parametrization=mup`): the coordinate check (Yang et al., Tensor Programs V, and the `mup` package's
`get_coord_data`): train models of widths 64 to 512 a few steps at one learning rate and watch the size of each
layer's output, and of its change since initialisation. Under muP both stay flat across widths; under the
standard parametrization they grow with width."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from systolic.optim.adamw import make_schedule
from systolic.workloads.lm.config import LMOptimConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.layer_kind import LayerKind
from systolic.workloads.lm.model.sublayers import make_ropes
from systolic.workloads.lm.model.transformer import Transformer
from systolic.workloads.lm.optimizer import make_lm_optimizer
from systolic.workloads.lm.train import make_loss_fn

WIDTHS = (64, 128, 256, 512)
VOCAB, BATCH, SEQ, STEPS = 256, 8, 16, 3
# 4 heads at every width (the head size grows), base width 64. Adam at 3e-3, constant, no decay: at 1e-2 and above
# the three steps are chaotic enough that the narrowest models scatter by 2x under muP too (measured).
MODEL = ModelConfig(layers=2, heads=4, max_seq_len=SEQ, dtype="float32", mup_base_width=64, vocab_size=VOCAB)
OPTIM = LMOptimConfig(lr=3e-3, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0)


def layer_outputs(model: Transformer, tokens: jax.Array) -> dict[str, jax.Array]:
    """Each layer's output on tokens (B, T): the embedding, every block's attention and MLP branches and its
    residual stream after them, and the logits; the forward pass of `Transformer._forward`, spelt out."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]  # (1, T)
    ropes = make_ropes(positions, model.cfg)  # None for GPT-2
    x = model.embed_tokens(tokens, positions)  # (B, T, D)
    out = {"embed": x}
    for i, block in enumerate(model.blocks):
        attn, _ = block.attn(block.attn_norm(x), ropes, LayerKind(sliding=False, rope=True), 0, None)  # (B, T, D)
        x = x + attn
        mlp = block.mlp(block.mlp_norm(x))  # (B, T, D)
        x = x + mlp
        out |= {f"attn{i}": attn, f"mlp{i}": mlp, f"block{i}": x}
    out["logits"] = model.readout(x)  # (B, T, V)
    return out


def coordinates(mcfg: ModelConfig, ocfg: LMOptimConfig, width: int) -> dict[str, tuple[float, float]]:
    """Per layer, (RMS of its output, RMS of the output's change since init) after STEPS steps at `width`."""
    mcfg = dataclasses.replace(mcfg, d_model=width)
    key = jax.random.PRNGKey(0)
    tokens = jax.random.randint(key, (BATCH, SEQ + 1), 0, VOCAB)  # the same batch at every width and step
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    model = Transformer(mcfg, VOCAB, rngs=nnx.Rngs(params=1))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = make_lm_optimizer(ocfg, mcfg, make_schedule(ocfg, STEPS))
    loss_fn = make_loss_fn(graphdef, mcfg.moe, 0.0)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: loss_fn(p, batch, key)[0])(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def outputs(params):
        return layer_outputs(nnx.merge(graphdef, params), batch["inputs"])

    before = outputs(params)
    opt_state = tx.init(params)
    for _ in range(STEPS):
        params, opt_state = step(params, opt_state)
    after = outputs(params)
    rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))  # noqa: E731
    return {k: (rms(after[k]), rms(after[k] - before[k])) for k in after}


def spread(table: dict[int, dict[str, tuple[float, float]]], layer: str, which: int) -> float:
    """max / min over the widths of one layer's output RMS (which=0) or change RMS (which=1)."""
    values = [table[w][layer][which] for w in table]
    return max(values) / min(values)


def check(family: str, parametrization: str, optimizer: str, widths=WIDTHS) -> dict[str, tuple[float, float]]:
    """Runs the coordinate check; prints the table (pytest -s); returns each layer's (output, change) spread."""
    mcfg = dataclasses.replace(MODEL, family=family, parametrization=parametrization)
    table = {w: coordinates(mcfg, dataclasses.replace(OPTIM, name=optimizer), w) for w in widths}
    print(f"\n{family} {parametrization} {optimizer}: RMS of each layer's output / of its change after {STEPS} steps")
    print("layer   " + "".join(f"{w:>18}" for w in widths) + "   spread")
    spreads = {}
    for layer in table[widths[0]]:
        spreads[layer] = (spread(table, layer, 0), spread(table, layer, 1))
        print(f"{layer:8s}" + "".join(f"{table[w][layer][0]:9.4f}/{table[w][layer][1]:.4f}" for w in widths)
              + f"   {spreads[layer][0]:.2f} {spreads[layer][1]:.2f}")
    return spreads


@pytest.mark.slow  # about 100 s on 2 cores: eight widths trained
def test_coordinate_check_llama_flat_under_mup_growing_under_standard():
    mup = check("llama", "mup", "adamw")
    assert all(max(s) <= 2.0 for s in mup.values()), mup
    standard = check("llama", "standard", "adamw", widths=(64, 512))  # the ends of the range suffice to see it
    branches = [k for k in standard if k.startswith(("attn", "mlp", "block"))]
    assert all(standard[k][1] > 4.0 for k in branches), standard  # measured 23x-73x
    assert standard["logits"][1] > 2.0, standard  # measured 5.6x


@pytest.mark.parametrize("family, optimizer", [("gpt2", "adamw"), ("llama", "muon")])
def test_coordinate_check_flat_under_mup(family, optimizer):
    """GPT-2's block (LayerNorm, biases, learned positions), and Muon's hidden steps (spectral scaling) with AdamW
    beside them; the widest against the narrowest."""
    spreads = check(family, "mup", optimizer, widths=(64, 512))
    assert all(max(s) <= 2.0 for s in spreads.values()), spreads


def test_mup_at_the_base_width_is_the_standard_model(tiny_lm):
    """At d_model = mup_base_width every muP multiplier is 1: the same losses, step for step, under AdamW. (Not
    under Muon: muP's Muon scales each matrix's step by sqrt(fan_out / fan_in) where the standard one uses Keller
    Jordan's sqrt(max(1, fan_out / fan_in)), so the MLP's down projection steps differ at any width.)"""
    mesh = tiny_lm.single_device_mesh()
    runs = [tiny_lm.run_steps(tiny_lm.make_cfg(*extra), mesh, 3)[2]
            for extra in ([], ["model.parametrization=mup", "model.mup_base_width=32"])]
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-6)


def test_mup_sharded_step_equals_single_device(tiny_lm):
    """muP at twice its base width (every multiplier active) on 1 device and on data=2, fsdp=2, tensor=2."""
    from systolic.config import MeshConfig
    from systolic.runtime import mesh as mesh_lib

    cfg = tiny_lm.make_cfg("model.parametrization=mup", "model.mup_base_width=16", "optim.name=muon")
    _, state1, losses1 = tiny_lm.run_steps(cfg, tiny_lm.single_device_mesh(), 3)
    _, state8, losses8 = tiny_lm.run_steps(cfg, mesh_lib.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)), 3)
    np.testing.assert_allclose(losses8, losses1, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(state8.params), jax.tree.leaves(state1.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_folded_into_standard_parameters_for_hugging_face(qk_norm):
    """`systolic convert to-hf` writes a muP model as standard parameters (Hugging Face has no muP multipliers):
    the standard model computes the same logits with them. Tied embeddings cannot be folded: a UserError."""
    from systolic.errors import UserError
    from systolic.workloads.lm.model.parametrization import to_standard

    mcfg = dataclasses.replace(MODEL, d_model=128, parametrization="mup", qk_norm=qk_norm)  # m = 2
    model = Transformer(mcfg, VOCAB, rngs=nnx.Rngs(params=0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    standard = Transformer(dataclasses.replace(mcfg, parametrization="standard"), VOCAB, rngs=nnx.Rngs(params=1))
    nnx.update(standard, to_standard(mcfg, params))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, SEQ), 0, VOCAB)
    np.testing.assert_allclose(np.asarray(standard(tokens)), np.asarray(model(tokens)), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(Transformer(dataclasses.replace(mcfg, parametrization="standard"), VOCAB,
                                                  rngs=nnx.Rngs(params=0))(tokens)), np.asarray(model(tokens)))
    with pytest.raises(UserError, match="tie_embeddings"):
        to_standard(dataclasses.replace(mcfg, tie_embeddings=True), params)
