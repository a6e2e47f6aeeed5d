"""Context parallelism (mesh.context, lm/parallel/context.py): ring and all-gather attention against plain causal attention,
the lm's loss and gradients on context meshes against one device, the compiled step's collectives, and the errors
for a sequence or setting that does not fit."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from systolic.data.tokenizer import make_tokenizer
from systolic.plan import hlo_collectives
from systolic.errors import ConfigError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate
from systolic.workloads.lm.parallel import context
from systolic.workloads.lm.model import cpu
from systolic.workloads.lm.train import abstract_batch, build_step, build_task, make_loss_fn
from tiny import MOE


# ATTENTION, FUNCTION LEVEL ------------------------------------------------------------------------------------


def _split_attention(variant: str, n: int, window: int = 0):
    """(q, k, v, segment_ids) in natural order -> attention output, computed on a ring of n devices in the
    load-balanced order and put back in natural order."""
    mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    split = context.Split(("context",), n)
    fn = context.ring_attention if variant == "ring" else context.allgather_attention

    def attend(q, k, v, seg):
        order = context.load_balanced_order(q.shape[1], n)
        local = jax.shard_map(lambda q, k, v, s: fn(q, k, v, s, split=split, window=window), mesh=mesh,
                              in_specs=(P(None, "context"),) * 4, out_specs=P(None, "context"))
        return local(q[:, order], k[:, order], v[:, order], seg[:, order])[:, np.argsort(order)]

    return attend


@pytest.mark.parametrize("variant, n, window", [("ring", 8, 0), ("ring", 4, 700), ("allgather", 4, 0)])
def test_split_attention_equals_causal_attention_at_4096_with_segments(variant, n, window):
    """4,096 positions of 1 row, 4 query heads sharing 2 key/value heads of size 8, 5 packed documents (one spans
    several devices' chunks): outputs and the gradients of q, k and v match the plain formulation."""
    T, H, KV, hd = 4096, 4, 2, 8
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(key, (1, T, h, hd)) for key, h in ((kq, H), (kk, KV), (kv, KV)))
    seg = jnp.searchsorted(jnp.asarray([300, 1800, 2000, 3500]), jnp.arange(T), side="right")[None].astype(jnp.int32)
    d_out = jax.random.normal(kd, (1, T, H, hd))
    split = jax.jit(_split_attention(variant, n, window))

    def reference(q, k, v, seg):
        return cpu.causal_attention(q, k, v, seg, window=window)

    np.testing.assert_allclose(split(q, k, v, seg), reference(q, k, v, seg), atol=2e-6)
    grads = [jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, seg) * d_out), argnums=(0, 1, 2)))(q, k, v)
             for f in (split, reference)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_load_balanced_layout_moves_there_and_back():
    n = 4
    mesh = jax.make_mesh((1, n), ("data", "context"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:n])
    x = jnp.arange(2 * 16).reshape(2, 16)
    with activate(mesh, (("batch", "data"), ("seq", "context"))):
        split = context.current_split()
        there = jax.jit(lambda x: context.to_balanced(x, split))(x)
        back = jax.jit(lambda x: context.from_balanced(x, split))(there)
    assert split == context.Split(("context",), n)
    np.testing.assert_array_equal(there, x[:, context.load_balanced_order(16, n)])
    np.testing.assert_array_equal(back, x)
    assert list(context.load_balanced_order(16, 4)) == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]


# THE LM ON CONTEXT MESHES ---------------------------------------------------------------------------------------


def _loss_and_grads(tiny_lm, extra: list[str], axes: dict[str, int] | None):
    """The first batch's loss and gradients at the initial parameters, on one device (axes None) or a mesh."""
    cfg = tiny_lm.make_cfg(*extra, *(f"mesh.{a}={n}" for a, n in (axes or {"data": 1}).items()))
    mesh = tiny_lm.single_device_mesh() if axes is None else mesh_lib.make_mesh(cfg.mesh)
    prepared = build_task(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    loss_fn = make_loss_fn(prepared.graphdef, cfg.model.moe, cfg.optim.z_loss)
    with activate(mesh, prepared.rules):
        state = prepared.task.init_state()
        grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
        (loss, _), grads = grad_fn(state.params, next(prepared.task.data), state.rng)
    return float(loss), jax.device_get(grads)


@pytest.mark.parametrize("extra, meshes", [
    ([], [{"context": 8}, {"data": 2, "fsdp": 2, "context": 2}]),
    pytest.param([], [{"context": 2, "data": 4}, {"context": 4, "data": 2}], marks=pytest.mark.slow),
    # Packed documents (segment ids, positions restarting at each document), with tensor parallelism.
    (["data.packing=documents"], [{"data": 2, "context": 2, "tensor": 2}]),
    pytest.param(["data.packing=documents"], [{"context": 8}], marks=pytest.mark.slow),
    (["model.context_attention=allgather"], [{"context": 4, "data": 2}]),
    # Learned positions, moved with their tokens.
    pytest.param(["model.family=gpt2"], [{"context": 4, "fsdp": 2}], marks=pytest.mark.slow),
    # Mixture of experts: dropless dispatch over the expert axis with the sequence split.
    ([*MOE], [{"data": 2, "expert": 2, "context": 2}]),
])
def test_loss_and_gradients_equal_one_device(tiny_lm, extra, meshes):
    loss, grads = _loss_and_grads(tiny_lm, [o for o in extra if "context_attention" not in o], None)
    for axes in meshes:
        got_loss, got_grads = _loss_and_grads(tiny_lm, extra, {"data": 1, **axes})
        assert got_loss == pytest.approx(loss, rel=1e-6), axes
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7, err_msg=str(axes)),
                     got_grads, grads)


@pytest.mark.slow
def test_same_losses_over_steps_on_one_device_and_context_mesh(tiny_lm):
    one = tiny_lm.run_steps(tiny_lm.make_cfg(), tiny_lm.single_device_mesh(), 3)[2]
    cfg = tiny_lm.make_cfg("mesh.data=2", "mesh.context=4")
    split = tiny_lm.run_steps(cfg, mesh_lib.make_mesh(cfg.mesh), 3)[2]
    np.testing.assert_allclose(split, one, rtol=2e-6)
    assert one[-1] < one[0]


def _compiled_hlo(tiny_lm, *overrides: str) -> str:
    cfg = tiny_lm.make_cfg(*overrides)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    step = build_step(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    with activate(mesh, step.rules):
        return step.train_step.lower(step.abstract, abstract_batch(cfg, step.batch_sharding)).compile().as_text()


def test_ring_step_permutes_keys_and_values_and_gathers_no_sequence(tiny_lm):
    """mesh data=2 x context=4, 8 rows of 16 tokens (4 per device), 2 key/value heads of 8: the ring moves
    f32[4,2,2,2,8] blocks (this device's 4 rows, 2 heads, 2 chunks of 2 tokens) with collective-permutes; nothing
    gathers a key/value tensor of the whole sequence (16 tokens), while the all-gather variant does."""
    hlo = _compiled_hlo(tiny_lm, "mesh.data=2", "mesh.context=4")
    collectives = hlo_collectives.read_collectives(hlo)
    # Per layer and step: 3 hops forward (k, v), 3 + 1 backward (k, v, dk, dv), plus the layout moves.
    assert collectives["collective-permute"].count >= 2 * (3 * 2 + 4 * 2)
    assert "f32[4,2,2,2,8]" in " ".join(re.findall(r"= (\S+) collective-permute", hlo))
    gathered = re.findall(r"= \(?(f32\[[0-9,]*\])\S* all-gather\(", hlo)
    assert not any(re.fullmatch(r"f32\[4,16,2,8\]|f32\[4,2,16,8\]", s) for s in gathered), gathered
    allgather = _compiled_hlo(tiny_lm, "mesh.data=2", "mesh.context=4", "model.context_attention=allgather")
    assert re.search(r"= \(?f32\[4,16,2,8\]\S* all-gather\(", allgather)


def test_errors_before_compiling(tiny_lm):
    cfg = tiny_lm.make_cfg("mesh.data=1", "mesh.context=8", "data.seq_len=24", "model.max_seq_len=32")
    with pytest.raises(ConfigError, match=r"data.seq_len=24 .* multiple of 16. Fix: e.g. data.seq_len=32"):
        build_step(cfg, mesh_lib.make_mesh(cfg.mesh), make_tokenizer(cfg.data.tokenizer))
    with pytest.raises(ConfigError, match="model.context_attention=allgather .* mesh.context=1"):
        tiny_lm.make_cfg("model.context_attention=allgather")
    with pytest.raises(ConfigError, match="model.attention=xla with mesh.context=2"):
        tiny_lm.make_cfg("mesh.context=2", "model.attention=xla")


def test_decoding_under_a_context_mesh_is_refused(tiny_lm):
    """Decoding runs with the sequence whole (generate uses one device): under a context mesh it says so."""
    from flax import nnx

    from systolic.errors import UserError

    cfg = tiny_lm.make_cfg("mesh.data=4", "mesh.context=2")
    mesh = mesh_lib.make_mesh(cfg.mesh)
    step = build_step(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    with activate(mesh, step.rules):
        model = nnx.merge(step.graphdef, step.init().params)
        with pytest.raises(UserError, match="Decoding with a KV cache runs with the sequence whole.*mesh.context=1"):
            model.decode(jnp.zeros((4, 1), jnp.int32), model.init_cache(4, 16))


# MEMORY -------------------------------------------------------------------------------------------------------

LONG = ["model.d_model=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "train.batch_size=1",
        "train.steps=10", "optim.warmup_steps=2"]


def _plan(seq_len: int, mesh: str) -> dict:
    """`systolic plan` of the tiny model on rows of seq_len tokens for H100s (XLA:CPU stands in for them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUMPY_DTYPE_PROMOTION")}
    proc = subprocess.run([sys.executable, "-m", "systolic", "plan", "lm", "--recipe", "lm-tiny", *LONG,
                           f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}", "--target", "h100",
                           "--mesh", mesh, "--json"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_plan_memory_per_device_falls_as_context_grows():
    """Rows of 32,768 tokens: one H100 would need 88 GiB (the (T, T) scores of every head), more than its 80; the
    ring holds 256 x T / 2n scores per head at a time, so each added device takes memory with it (measured 2026-12-04:
    context=4 97 MiB, context=8 49 MiB per chip)."""
    one = _plan(32768, "data=1")
    assert not one["fits"] and one["peak_bytes"] > 80 * 2**30
    four, eight = _plan(32768, "context=4"), _plan(32768, "context=8")
    assert four["fits"] and eight["peak_bytes"] < 0.6 * four["peak_bytes"] < 0.01 * one["peak_bytes"]
    assert "ring over mesh.context=8" in " ".join(eight["notes"])
    assert eight["collectives"]["collective-permute"]["count"] > 0


@pytest.mark.slow
def test_32k_tokens_train_on_8_devices_with_context_8(tiny_lm):
    """2 steps of 1 row of 32,768 tokens (byte tokens of the standard library) on context=8, with finite losses near
    ln(vocab) (random init). Measured on the 2-core CPU: see docs/scaling-out.md."""
    cfg = tiny_lm.make_cfg("data.path=", "data.max_bytes=1500000", "data.val_percent=30", "data.seq_len=32768",
                           "model.max_seq_len=32768", "train.batch_size=1", "mesh.data=1", "mesh.context=8")
    _, _, losses = tiny_lm.run_steps(cfg, mesh_lib.make_mesh(cfg.mesh), 2)
    assert np.isfinite(losses).all() and abs(losses[0] - np.log(256)) < 0.5


@pytest.mark.slow
def test_cli_trains_on_a_context_mesh_and_refuses_a_length_that_does_not_split(corpus_dir, tmp_path, capsys):
    """`systolic train lm` end to end on data=2 x context=4 with packed documents (evaluation on the mesh, the sample
    on one device), and data.seq_len=24 on context=8 as one paragraph with exit code 2."""
    from systolic.cli import main
    from tiny import LM_CLI_QUIET, TINY_LM

    args = ["train", "lm", *TINY_LM, *LM_CLI_QUIET, f"data.path={corpus_dir}", "sample.max_new_tokens=4", "-q"]
    assert main([*args, "mesh.data=2", "mesh.context=4", "data.packing=documents",
                 "--run-dir", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    assert main([*args, "mesh.data=1", "mesh.context=8", "data.seq_len=24", "--run-dir", str(tmp_path / "bad")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "data.seq_len=24 with the sequence split over 8 devices" in err and "Traceback" not in err
