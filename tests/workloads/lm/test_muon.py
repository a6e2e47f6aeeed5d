"""`optim.name=muon` on the lm: which weights Muon moves, sharded == single device, what the sharded step
communicates, a checkpoint round trip, the optimizer state in `systolic plan`, and LoRA refused."""

import json

import jax
import numpy as np
import pytest

from systolic import cli
from systolic import config as config_lib
from systolic.config import CheckpointConfig, MeshConfig
from systolic.data.tokenizer import make_tokenizer
from systolic.engine.checkpoint import Checkpointer
from systolic.plan.hlo_collectives import read_collectives
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.parametrization import role
from systolic.workloads.lm.train import abstract_batch, build_step, build_task
from tiny import TINY_LM

MUON = ["optim.name=muon"]


def hidden_count(params) -> int:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return sum(x.size for path, x in flat if role(path) == "hidden")


@pytest.mark.parametrize("layout", ["list", "scan"])
def test_muon_sharded_step_equals_single_device(tiny_lm, layout):
    cfg = tiny_lm.make_cfg(*MUON, f"model.scan_layers={layout == 'scan'}")
    _, state1, losses1 = tiny_lm.run_steps(cfg, tiny_lm.single_device_mesh(), 3)
    prepared, state8, losses8 = tiny_lm.run_steps(cfg, mesh_lib.make_mesh(MeshConfig(data=1, fsdp=4, tensor=2)), 3)
    np.testing.assert_allclose(losses8, losses1, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(state8.params), jax.tree.leaves(state1.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert prepared.task.train_step._cache_size() == 1
    # The momentum is laid out as its parameter (split over fsdp and tensor), not gathered.
    mu = state8.opt_state[1].inner_states["muon"].inner_state[0].mu
    wq = mu["blocks"][0]["attn"]["wq"] if layout == "list" else mu["blocks"]["attn"]["wq"]
    assert "fsdp" in str(wq.sharding.spec) and "tensor" in str(wq.sharding.spec)


def test_muon_moves_the_hidden_matrices_and_adamw_the_rest(tiny_lm):
    """Muon's state holds one momentum per hidden matrix; AdamW's two moments cover the embeddings, the output
    layer and the norms, and nothing else. Muon's steps beat AdamW's on the first steps of the tiny lm."""
    mesh = tiny_lm.single_device_mesh()
    _, state, losses = tiny_lm.run_steps(tiny_lm.make_cfg(*MUON), mesh, 5)
    partitions = state.opt_state[1].inner_states
    muon_mu = jax.tree_util.tree_flatten_with_path(partitions["muon"].inner_state[0].mu)[0]
    adam_mu = jax.tree_util.tree_flatten_with_path(partitions["adamw"].inner_state[0].mu)[0]
    assert {role(p) for p, _ in muon_mu} == {"hidden"} and len(muon_mu) == 7 * 2  # 7 projections x 2 layers
    assert {role(p) for p, _ in adam_mu} == {"input", "output", "vector"}
    assert len(muon_mu) + len(adam_mu) == len(jax.tree.leaves(state.params))
    _, _, adam_losses = tiny_lm.run_steps(tiny_lm.make_cfg(), mesh, 5)
    assert losses[-1] < adam_losses[-1], (losses, adam_losses)


def collectives(cfg: LMConfig, mesh) -> dict:
    step = build_step(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    with activate(mesh, step.rules):
        text = step.train_step.lower(step.abstract, abstract_batch(cfg, step.batch_sharding)).compile().as_text()
    return read_collectives(text), step


def test_sharded_muon_gathers_each_matrix_once(tiny_lm):
    """On fsdp=4, tensor=2, the Muon step's collectives are AdamW's plus all-gathers of about the hidden matrices'
    bytes (each gathered once for the Newton-Schulz iteration; measured 1.33x, as some matrices gather in two
    stages), and no more all-reduces. (Optax's Muon, run on the sharded momentum, added all-gathers of 6.0x those
    bytes and all-reduces besides: docs/optimizers.md.)"""
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    adamw, _ = collectives(tiny_lm.make_cfg(), mesh)
    ours, step = collectives(tiny_lm.make_cfg(*MUON), mesh)
    matrix_bytes = 4 * hidden_count(step.abstract.params)
    extra = ours["all-gather"].bytes - adamw["all-gather"].bytes
    assert 0.9 * matrix_bytes < extra < 1.5 * matrix_bytes, (extra, matrix_bytes)
    assert ours["all-reduce"].bytes == adamw["all-reduce"].bytes


def test_muon_checkpoint_round_trip(tiny_lm, tmp_path):
    cfg = tiny_lm.make_cfg(*MUON)
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    task = build_task(cfg, mesh, make_tokenizer(cfg.data.tokenizer)).task
    with activate(mesh, build_step(cfg, mesh, make_tokenizer(cfg.data.tokenizer)).rules):
        state = task.init_state()
        for _ in range(2):
            state, _ = task.train_step(state, next(task.data))
        saved = jax.device_get(state)
        ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig())
        ckpt.save(state, task.data.get_state(), {"workload": "lm"})
        ckpt.wait()
        restored, _, _ = ckpt.restore(2, task.abstract_state)
        ckpt.close()
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_plan_reports_muons_smaller_optimizer_state(capsys):
    """Muon keeps one moment per hidden matrix where AdamW keeps two: `systolic plan` shows the difference."""
    bytes_ = {}
    for name in ("adamw", "muon"):
        overrides = [*TINY_LM, "model.dtype=float32", f"optim.name={name}"]
        assert cli.main(["plan", "lm", *overrides, "--target", "h200", "--mesh", "fsdp=8", "--json"]) == 0
        bytes_[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["optimizer_bytes"]
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, TINY_LM))
    step = build_step(cfg, mesh_lib.make_mesh(MeshConfig(data=1, fsdp=8, tensor=1)), make_tokenizer(cfg.data.tokenizer))
    per_device = 4 * hidden_count(step.abstract.params) / 8  # every hidden matrix divides over fsdp=8 here
    assert bytes_["adamw"] - bytes_["muon"] == pytest.approx(per_device, abs=64), bytes_


def test_muon_with_lora_is_refused(capsys):
    assert cli.main(["train", "lm", *TINY_LM, *MUON, "model.lora.rank=4", "-q"]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert "optim.name=muon with model.lora.rank=4" in err and "optim.name=adamw" in err
