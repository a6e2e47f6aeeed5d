"""`optim.moment_dtype=bfloat16` on the lm: every moment of AdamW and Muon stored in bfloat16 and laid out as its
parameter on 8 devices, checkpoints that round-trip and convert between dtypes, the memory estimate and the plan's
optimizer bytes at the moments' dtype, and decays that bfloat16 cannot hold refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from systolic.config import CheckpointConfig, MeshConfig
from systolic.data.tokenizer import make_tokenizer
from systolic.engine.checkpoint import Checkpointer
from systolic.engine.state import param_count
from systolic.errors import ConfigError
from systolic.optim import muon
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate
from systolic.workloads.lm import preflight
from systolic.workloads.lm.model import sizes
from systolic.workloads.lm.train import build_step, build_task

BF16 = "optim.moment_dtype=bfloat16"


def moments(opt_state) -> list[jax.Array]:
    """The moment arrays of an lm optimizer state: Adam's mu and nu, Muon's mu (not the step counts)."""
    is_state = lambda x: isinstance(x, (optax.ScaleByAdamState, muon.MuonState))  # noqa: E731
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
    return [leaf for s in found for leaf in jax.tree.leaves((s.mu, getattr(s, "nu", ())))]


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bfloat16_moments_are_sharded_as_their_parameters_and_compile_once(tiny_lm, name):
    """On fsdp=4 x tensor=2 every moment is bfloat16 and split as its parameter; three steps compile once and
    their losses stay within bfloat16 rounding of float32 moments'."""
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    prepared, state, losses = tiny_lm.run_steps(tiny_lm.make_cfg(f"optim.name={name}", BF16), mesh, 3)
    _, state32, losses32 = tiny_lm.run_steps(tiny_lm.make_cfg(f"optim.name={name}"), mesh, 3)
    found = moments(state.opt_state)
    assert len(found) == len(moments(state32.opt_state)) >= len(jax.tree.leaves(state.params))
    assert {x.dtype for x in found} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in moments(state32.opt_state)} == {jnp.dtype(jnp.float32)}
    assert any("fsdp" in str(x.sharding.spec) and "tensor" in str(x.sharding.spec) for x in found)
    for a, b in zip(found, moments(state32.opt_state)):
        assert a.sharding == b.sharding
    assert prepared.task.train_step._cache_size() == 1
    np.testing.assert_allclose(losses, losses32, rtol=1e-3)
    # The rounding acted: the parameters after the steps differ from float32 moments' (the losses may not yet).
    pairs = zip(jax.tree.leaves(state.params), jax.tree.leaves(state32.params))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)


def train_and_save(tiny_lm, cfg, mesh, directory):
    """(initial state, state after 2 steps, both on the host); the second saved in `directory`."""
    prepared = build_task(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    with activate(mesh, prepared.rules):
        initial = jax.device_get(prepared.task.init_state())
        state = prepared.task.init_state()
        for _ in range(2):
            state, _ = prepared.task.train_step(state, next(prepared.task.data))
        ckpt = Checkpointer(directory, CheckpointConfig())
        ckpt.save(state, prepared.task.data.get_state(), {"workload": "lm"})
        ckpt.wait()
        ckpt.close()
    return initial, jax.device_get(state)


def restore(cfg, mesh, directory):
    prepared = build_task(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    with activate(mesh, prepared.rules):
        ckpt = Checkpointer(directory, CheckpointConfig())
        restored, _, _ = ckpt.restore(2, prepared.task.abstract_state)
        ckpt.close()
    return jax.device_get(restored)


def test_bfloat16_moments_round_trip_and_convert_to_the_configs_dtype(tiny_lm, tmp_path):
    """A run saved with bfloat16 moments restores them exactly; resumed with float32 moments (the optim section
    may change on resume) they come back as float32 with the same values, and float32 moments restored into a
    bfloat16 config are rounded to it: the checkpoint converts, it does not refuse."""
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    cfg16, cfg32 = tiny_lm.make_cfg(BF16), tiny_lm.make_cfg()
    initial, saved = train_and_save(tiny_lm, cfg16, mesh, tmp_path / "bf16")
    assert all(not np.array_equal(a, b) for a, b in zip(moments(saved.opt_state), moments(initial.opt_state)))
    restored = restore(cfg16, mesh, tmp_path / "bf16")
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    widened = restore(cfg32, mesh, tmp_path / "bf16")
    for a, b in zip(moments(widened.opt_state), moments(saved.opt_state)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, np.asarray(b, np.float32))
    _, saved32 = train_and_save(tiny_lm, cfg32, mesh, tmp_path / "f32")
    narrowed = restore(cfg16, mesh, tmp_path / "f32")
    for a, b in zip(moments(narrowed.opt_state), moments(saved32.opt_state)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(a, np.asarray(b).astype(jnp.bfloat16))


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_memory_estimate_and_plan_count_the_moments_at_their_dtype(tiny_lm, name):
    """preflight.training_bytes drops by exactly the moments' halving (2 bytes a parameter per moment: AdamW two,
    Muon's lower bound one), a lower bound on the real state's drop; the optimizer bytes that `systolic plan`
    reports (the abstract state's per device) halve."""
    cfg32, cfg16 = tiny_lm.make_cfg(f"optim.name={name}"), tiny_lm.make_cfg(f"optim.name={name}", BF16)
    vocab = make_tokenizer(cfg32.data.tokenizer).vocab_size
    estimated_params = sizes.param_count(cfg32.model, vocab)
    per_moment = 2 if name == "adamw" else 1
    drop = preflight.training_bytes(cfg32, vocab) - preflight.training_bytes(cfg16, vocab)
    assert drop == 2 * per_moment * estimated_params
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    steps = {d: build_step(c, mesh, make_tokenizer(c.data.tokenizer)) for d, c in (("f32", cfg32), ("bf16", cfg16))}
    planned = {d: mesh_lib.bytes_per_device(s.abstract.opt_state) for d, s in steps.items()}
    counts = len(jax.tree.leaves(steps["f32"].abstract.opt_state)) - len(moments(steps["f32"].abstract.opt_state))
    assert planned["f32"] - planned["bf16"] == pytest.approx(planned["f32"] / 2, abs=4 * counts)
    real_drop = 2 * sum(x.size for x in moments(steps["f32"].abstract.opt_state))
    assert drop <= real_drop and real_drop >= 2 * per_moment * param_count(steps["f32"].abstract.params)


@pytest.mark.parametrize("overrides, named", [
    (["optim.b2=0.999"], "optim.b2=0.999"),
    (["optim.name=muon", "optim.muon_momentum=0.998"], "optim.muon_momentum=0.998"),
])
def test_decays_that_bfloat16_cannot_hold_are_refused(tiny_lm, overrides, named):
    with pytest.raises(ConfigError) as raised:
        tiny_lm.make_cfg(BF16, *overrides)
    message = str(raised.value)
    assert named in message and "optim.moment_dtype=float32" in message and "optim.b2=0.95" in message
    tiny_lm.make_cfg(*overrides)  # float32 moments hold them
    tiny_lm.make_cfg(BF16, "optim.b2=0.99")
