"""Quantization-aware training (model.quant=int8|fp8, lm/model/quant.py through Qwix): a projection's forward pass
equals a float64 NumPy reference of absmax fake quantization (each activation row and each weight output channel its
own scale); the gradients reach the float32 weights (straight through the rounding), near the float model's; the
train step on 8 devices equals one device, keeps float32 weights and optimizer state and resumes bit for bit; the
modes it combines with (pipeline, context parallelism, mixture of experts, LoRA from a float run) train; the TPU
compiler multiplies int8 operands."""

import dataclasses
import functools
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from hlo import int8_dots
from tiny import LM_CLI_QUIET, MOE, TINY_LM

from systolic import cli
from systolic import config as config_lib
from systolic.config import MeshConfig
from systolic.engine import finished
from systolic.runtime import mesh as mesh_lib
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model import quant
from systolic.workloads.lm.model.transformer import make_model


@pytest.fixture(autouse=True)
def standard_promotion():
    """Qwix multiplies its int32 products by float32 scales through implicit promotion, which the tests' strict
    promotion (conftest.py) refuses; users run with JAX's standard promotion. Scoped to the test, so it also covers
    the backward passes that jax traces after the forward call returns (under scan)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


# ONE PROJECTION AGAINST NUMPY ---------------------------------------------------------------------------------

# Qwix's symmetric bounds: int8 rounds to [-128, 127] with the absmax at 127.5 (the top bucket used in full);
# float8_e4m3fn's largest finite value is 448.
BOUND = {"int8": 127.5, "fp8": 448.0}


def fake_quantized(a: np.ndarray, contracted: tuple[int, ...], qtype: str) -> np.ndarray:
    """a (float64) quantized and dequantized: one absmax scale per slice over the contracted axes."""
    scale = np.abs(a).max(axis=contracted, keepdims=True) / BOUND[qtype]
    if qtype == "int8":
        q = np.clip(np.round(a / scale), -128, 127)
    else:
        q = np.clip(a / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return q * scale


def absmax_positive(a: np.ndarray, contracted: tuple[int, ...]) -> np.ndarray:
    """a with each slice over the contracted axes signed so that its largest magnitude is positive. The absmax
    lands on the int8 bucket boundary 127.5 exactly: a positive one saturates at 127 whichever way the quotient
    rounds, a negative one becomes -128 or -127 by the last bit of XLA's float32 arithmetic (it multiplies by
    1/127.5), which a float64 reference cannot follow."""
    flat = np.moveaxis(a, contracted, tuple(range(a.ndim - len(contracted), a.ndim)))
    flat = flat.reshape(*flat.shape[: a.ndim - len(contracted)], -1)
    top = np.take_along_axis(flat, np.abs(flat).argmax(-1)[..., None], -1)  # (*kept, 1)
    sign = np.expand_dims(np.sign(top[..., 0]), tuple(contracted))
    return a * sign


@pytest.mark.parametrize("qtype", ["int8", "fp8"])
@pytest.mark.parametrize("contract", [1, 2], ids=["x@wq", "out@wo"])
def test_projection_equals_fake_quantized_numpy_reference(qtype, contract):
    rng = np.random.default_rng(0)
    x_shape, w_shape = ((2, 6, 32), (32, 4, 8)) if contract == 1 else ((2, 6, 4, 8), (4, 8, 32))
    x_axes = tuple(range(len(x_shape) - contract, len(x_shape)))  # each row (token) its own scale
    w_axes = tuple(range(contract))  # each output channel its own scale
    rows = rng.uniform(0.1, 3.0, size=(*x_shape[:2], *(1,) * (len(x_shape) - 2)))  # rows of different sizes
    x = absmax_positive(rng.normal(size=x_shape) * rows, x_axes)
    w = absmax_positive(rng.normal(0.0, 0.1, size=w_shape), w_axes)
    got = np.asarray(jax.jit(quant.project, static_argnums=(2, 3))(jnp.asarray(x, jnp.float32),
                                                                   jnp.asarray(w, jnp.float32), contract, qtype))
    want = np.tensordot(fake_quantized(x, x_axes, qtype), fake_quantized(w, w_axes, qtype), contract)
    exact = np.tensordot(x, w, contract)
    assert got.shape == want.shape == exact.shape
    # int8: an exact int32 product, scaled in float32; fp8: products of e4m3 values, summed in float32.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # ...and the quantization is visible: far above that tolerance from the float product.
    assert np.abs(exact - want).max() > 100 * 1e-5 * np.abs(want).max()


# THE MODEL'S GRADIENTS ----------------------------------------------------------------------------------------

VOCAB = 64
LLAMA = ModelConfig(family="llama", d_model=32, layers=2, heads=4, kv_heads=2, mlp_dim=64, max_seq_len=16,
                    dtype="float32", scan_layers=True)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 12)), jnp.int32)
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@functools.partial(jax.jit, static_argnums=0)
def loss_and_grads(graphdef, params):
    """The next-token cross-entropy of TOKENS and its gradient."""

    def loss(p):
        logits = nnx.merge(graphdef, p)(TOKENS[:, :-1])  # (B, T-1, V)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, TOKENS[:, 1:, None], -1)[..., 0])

    return jax.value_and_grad(loss)(params)


def test_gradients_reach_the_float_weights_near_the_float_models():
    """Straight-through: each float32 weight gets the gradient of the quantized product as if the rounding were the
    identity, evaluated at the quantized operands, so it is near the float model's gradient but not equal."""
    abstract = nnx.state(nnx.eval_shape(lambda: make_model(LLAMA, VOCAB, 0)), nnx.Param)
    rng = np.random.default_rng(0)
    # NumPy draws (jax.random under jit compiles slowly on CPU); norm scales near 1, the rest near 0.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(float(path[-1].key == "scale"), 0.1, x.shape), jnp.float32),
        nnx.to_pure_dict(abstract))
    results = {}
    for q in ("none", "int8"):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: make_model(dataclasses.replace(LLAMA, quant=q), VOCAB, 0)))
        results[q] = loss_and_grads(graphdef, params)
    (loss_f, grads_f), (loss_q, grads_q) = results["none"], results["int8"]
    assert loss_q != loss_f and abs(loss_q - loss_f) < 1e-2 * abs(loss_f)
    checked = 0
    for path, g_q in jax.tree_util.tree_leaves_with_path(grads_q):
        g_f, g_q = np.asarray(_at(grads_f, path)), np.asarray(g_q)
        name = jax.tree_util.keystr(path)
        assert g_q.dtype == np.float32 and np.all(np.isfinite(g_q)), name
        if any(f"'{p}'" in name for p in PROJECTIONS):
            relative = np.linalg.norm(g_q - g_f) / np.linalg.norm(g_f)
            assert 0 < relative < 0.1, (name, relative)
            checked += 1
    assert checked == len(PROJECTIONS)  # each stacked (scanned) projection weight once


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


# THE TRAIN STEP -----------------------------------------------------------------------------------------------

INT8 = ["model.quant=int8"]


def test_sharded_step_equals_single_device_with_float32_weights_and_optimizer_state(tiny_lm):
    cfg = tiny_lm.make_cfg(*INT8)
    _, state1, losses1 = tiny_lm.run_steps(cfg, tiny_lm.single_device_mesh(), 3)
    prepared, state8, losses8 = tiny_lm.run_steps(cfg, mesh_lib.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)), 3)
    # A layout sums in another order, so an activation may move by an ulp and a value on a bucket boundary round
    # to the next int8 value, which moves that gradient entry by about 1/127 and flows on through the layers. Adam's
    # first steps are about lr x sign(gradient), so an entry whose gradient is near 0 may move by up to a step: the
    # losses agree to float32 rounding, 95% of the parameters to 1e-5 (97% here), all within one Adam step.
    np.testing.assert_allclose(losses8, losses1, rtol=1e-5)
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(s.params)]) for s in (state8, state1))
    assert np.mean(np.abs(a - b) <= 1e-5) > 0.95
    np.testing.assert_allclose(a, b, rtol=0, atol=cfg.optim.lr)
    assert prepared.task.train_step._cache_size() == 1  # steps 2 and 3 reused the first compilation
    # Quantization is the forward pass's: master weights and Adam's moments stay float32.
    floats = [x for x in jax.tree.leaves((state8.params, state8.opt_state)) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}
    assert len(floats) == 3 * len(jax.tree.leaves(state8.params))  # the weights, the first and second moments


@pytest.mark.parametrize("extra, axes", [
    (["model.context_attention=allgather"], {"data": 2, "context": 2, "tensor": 2}),
    pytest.param(["model.scan_layers=true", "pipeline.microbatches=2"], {"data": 4, "stage": 2},
                 marks=pytest.mark.slow),
    # The experts stay float (lm/model/quant.py); the attention projections are quantized.
    pytest.param(MOE, {"data": 2, "expert": 2, "tensor": 2}, marks=pytest.mark.slow),
])
def test_quantized_training_runs_on_each_parallel_layout_as_on_one_device(tiny_lm, extra, axes):
    one = tiny_lm.make_cfg(*INT8, *[o for o in extra if not o.startswith(("pipeline.", "model.context_attention"))])
    cfg = tiny_lm.make_cfg(*INT8, *extra, *(f"mesh.{a}={n}" for a, n in {"data": 1, **axes}.items()))
    losses1 = tiny_lm.run_steps(one, tiny_lm.single_device_mesh(), 2)[2]
    losses = tiny_lm.run_steps(cfg, mesh_lib.make_mesh(cfg.mesh), 2)[2]
    np.testing.assert_allclose(losses, losses1, rtol=1e-4)


def _losses(run: Path) -> dict[tuple[str, int], float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {(r["split"], r["step"]): r["loss"] for r in rows}


CLI = ["train", "lm", *TINY_LM, *LM_CLI_QUIET, "observe.log_every=1"]


@pytest.fixture(scope="module")
def float_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("float") / "run"
    with jax.numpy_dtype_promotion("standard"):
        assert cli.main([*CLI, "--run-dir", str(run)]) == 0
    return run


def test_quantized_run_differs_from_float_and_resumes_exactly(float_run, tmp_path, capsys):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert cli.main([*CLI, *INT8, "--run-dir", str(whole)]) == 0
    # The same data and initial weights: the quantized forward pass alone makes the losses differ.
    quantized, floating = _losses(whole), _losses(float_run)
    assert sorted(quantized) == sorted(floating) and quantized[("train", 1)] != floating[("train", 1)]
    assert cli.main([*CLI, *INT8, "loop.stop_at_step=4", "--run-dir", str(resumed)]) == 0
    assert cli.main([*CLI, *INT8, "--run-dir", str(resumed)]) == 0
    assert "resumed from checkpoint step 4" in capsys.readouterr().err
    assert _losses(resumed) == quantized  # bit for bit, the validation loss too


def test_lora_fine_tune_of_a_float_run_with_quantized_projections(float_run, tmp_path):
    """model.quant leaves the parameters as they are, so a fine-tune from a float run (init.from) may set it:
    quantization-aware LoRA, the frozen base weights' projections quantized, the adapters float."""
    run = tmp_path / "lora"
    args = [*CLI, f"init.from={float_run}", *INT8, "model.lora.rank=4", "model.lora.targets=all", "optim.lr=1e-2",
            "train.steps=4", "--run-dir", str(run)]
    assert cli.main(args) == 0
    losses = _losses(run)
    assert sorted(losses) == [("eval", 4), ("train", 1), ("train", 2), ("train", 3), ("train", 4)]
    assert all(np.isfinite(list(losses.values())))
    model = finished.read_config(run, LMConfig, "test").model
    assert (model.quant, model.lora.rank, model.d_model) == ("int8", 4, 32)


# WHAT THE TPU COMPILER RUNS -----------------------------------------------------------------------------------

@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]'): no TPU compiler")
def test_tpu_train_step_multiplies_int8_operands():
    """The lm train step compiled by libtpu for v5e:2x2 (compile-only devices, no TPU): with model.quant=int8 the
    forward pass's seven projections of the (scanned) block are int8 x int8 dots; without it, none is."""
    from systolic.plan import targets
    from systolic.plan.planner import devices_for
    from systolic.runtime.platform import compiling_for
    from systolic.workloads.lm.entry import plan

    target = targets.resolve("v5e-4", mesh_devices=0)
    devices = devices_for(target)
    counts = {}
    # Compile-only TPU programs cannot go through the persistent cache (it needs a TPU to read them back).
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        for q in ("none", "int8"):
            overrides = [*TINY_LM, "model.scan_layers=true", "mesh.data=1", "mesh.fsdp=4", f"model.quant={q}"]
            cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))
            with compiling_for("tpu"):
                hlo = plan(cfg, devices).lowered.compile().as_text()
            counts[q] = int8_dots(hlo)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    assert counts["none"] == 0 and counts["int8"] >= len(PROJECTIONS), counts


@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]'): no TPU compiler")
def test_tpu_serving_step_multiplies_int8_operands_with_w8a8():
    """The serving engine's step (lm/serve/step.py) compiled by libtpu for one v5e chip, with the weights stored in
    int8 (quant.quantize_params): w8a8 (model.quant=int8) multiplies int8 x int8 in each projection; weight-only
    int8 multiplies the bfloat16 activations by the int8 weights as stored, the scales applied to the product (a
    dequantized weight, q * scale, was computed in float32 element by element inside the dot: the Llama-3-8B shape
    decoded at 51 ms a token on a v5e where its int8 weights stream in 10 ms)."""
    from systolic.plan import targets
    from systolic.plan.planner import devices_for
    from systolic.runtime.platform import compiling_for
    from systolic.kernels.paged_attention.metadata import RaggedBatch
    from systolic.workloads.lm.serve.step import MAX_BANNED, RowSampling, engine_step

    one = jax.sharding.SingleDeviceSharding(devices_for(targets.resolve("v5e-1", mesh_devices=0))[0])

    def spec(*shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=one)

    T, S, pages, page_size = 16, 4, 32, 16  # tokens and rows of one step; the pool's pages
    counts = {}
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        for scheme in ("w8a8", "int8"):
            cfg = dataclasses.replace(LLAMA, dtype="auto", quant=quant.SCHEMES[scheme][1])
            with compiling_for("tpu"), nnx.use_eager_sharding(False):
                graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make_model(cfg, VOCAB, 0)), nnx.Param)
                params = jax.eval_shape(lambda p: quant.quantize_params(p, scheme, stacked=True),
                                        nnx.to_pure_dict(abstract))
                params = jax.tree.map(lambda s: spec(*s.shape, dtype=s.dtype), params)
                pool = spec(cfg.layers, pages, page_size, cfg.n_kv_heads * 2 * cfg.d_head, dtype=jnp.bfloat16)
                batch = RaggedBatch(spec(T), spec(T), spec(T), spec(), spec(S, pages), spec(S), spec(S + 1), spec(1),
                                    spec(S), spec(S))
                sampling = RowSampling(spec(S, dtype=jnp.float32), spec(S), spec(S, dtype=jnp.float32),
                                       spec(S, 2, dtype=jnp.uint32), spec(S), spec(S, dtype=jnp.float32),
                                       spec(S, MAX_BANNED))
                step = jax.jit(functools.partial(engine_step, graphdef), static_argnums=7)
                hlo = step.lower(params, pool, spec(T), spec(2, S), batch, sampling, spec(), None).compile().as_text()
                counts[scheme] = int8_dots(hlo), int8_dots(hlo, ("bf16", "s8"))
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    assert counts["w8a8"][0] >= len(PROJECTIONS), counts
    assert counts["int8"][0] == 0 and counts["int8"][1] >= len(PROJECTIONS), counts
