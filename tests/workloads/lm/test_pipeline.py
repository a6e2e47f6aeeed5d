"""Pipeline parallelism (mesh.stage, lm/parallel/pipeline.py): the pipelined loss and gradients equal one device's for both
schedules, alone and with data, fsdp and tensor; the compiled step passes activations round the ring of stages with
collective-permutes; a layout the axes do not divide is a ConfigError before anything compiles."""

import functools
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from systolic.config import MeshConfig
from systolic.data.tokenizer import make_tokenizer
from systolic.plan import hlo_collectives
from systolic.errors import ConfigError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate
from systolic.workloads.lm.parallel import pipeline
from systolic.workloads.lm.train import abstract_batch, build_step, make_loss_fn

SCANNED = ["model.scan_layers=true", "model.layers=4"]  # the stages split the stacked layer axis


def loss_and_grads(cfg, mesh) -> tuple[float, dict]:
    """The loss fn's value and gradients at the initial parameters on one fixed batch of random tokens."""
    step = build_step(cfg, mesh, make_tokenizer(cfg.data.tokenizer))  # checks the layout
    loss_fn = make_loss_fn(step.graphdef, cfg.model.moe, 0.0, cfg.pipeline)
    tokens = np.random.default_rng(0).integers(0, step.vocab, (cfg.train.batch_size, cfg.data.seq_len + 1), np.int32)
    with activate(mesh, step.rules):
        params = step.init().params
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        batch = jax.device_put(batch, step.batch_sharding)
        loss, grads = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None)[0]))(params, batch)
    return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def one_device(tiny_lm):
    """layers -> the reference: loss and gradients on one device, computed once per layer count."""

    @functools.cache
    def reference(layers: int) -> tuple[float, dict]:
        cfg = tiny_lm.make_cfg(*SCANNED, f"model.layers={layers}", "mesh.data=1")
        return loss_and_grads(cfg, tiny_lm.single_device_mesh())

    return reference


LAYOUTS = [
    # (mesh axes, pipeline settings, layers)
    ({"data": 4, "stage": 2}, {"microbatches": 2}, 4),  # GPipe
    # With context parallelism: ring attention's shard_map nests inside the pipeline's (over the axes left auto).
    pytest.param({"data": 2, "context": 2, "stage": 2}, {"microbatches": 2}, 4, marks=pytest.mark.slow),
    ({"data": 4, "stage": 2}, {"microbatches": 2, "repeats": 2}, 4),  # circular: stage 0 holds layers 0 and 2
    pytest.param({"data": 2, "stage": 4}, {"microbatches": 4}, 4, marks=pytest.mark.slow),
    pytest.param({"data": 2, "stage": 4}, {"microbatches": 4, "repeats": 2}, 8, marks=pytest.mark.slow),
    pytest.param({"data": 2, "stage": 2, "fsdp": 2}, {"microbatches": 2}, 4, marks=pytest.mark.slow),
    pytest.param({"data": 1, "stage": 2, "fsdp": 2, "tensor": 2}, {"microbatches": 4, "repeats": 2}, 4,
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("axes, pipe, layers", LAYOUTS)
def test_pipelined_loss_and_gradients_equal_one_device(tiny_lm, one_device, axes, pipe, layers):
    cfg = tiny_lm.make_cfg(*SCANNED, f"model.layers={layers}", *(f"mesh.{a}={n}" for a, n in axes.items()),
                           *(f"pipeline.{k}={v}" for k, v in pipe.items()))
    loss, grads = loss_and_grads(cfg, mesh_lib.make_mesh(cfg.mesh))
    ref_loss, ref_grads = one_device(layers)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)
    for (path, g), ref in zip(flat, ref_flat, strict=True):
        # float32 sums over microbatches and over devices in another order: equal to a few ulps of the largest.
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max(), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("extra", [
    ["mesh.data=4", "mesh.stage=2", "pipeline.microbatches=2"],
    # Each of grad_accum's micro-steps is pipelined in its turn.
    pytest.param(["mesh.data=2", "mesh.stage=2", "mesh.tensor=2", "pipeline.microbatches=2", "train.grad_accum=2"],
                 marks=pytest.mark.slow),
])
def test_train_steps_and_validation_on_a_pipeline_match_one_device(tiny_lm, extra):
    """The real train step (data, optimizer, guard) and the validation on a pipeline (both pipelined): the same three
    losses and validation loss as one device."""
    accum = [o for o in extra if o.startswith("train.grad_accum")]
    one_cfg = tiny_lm.make_cfg(*SCANNED, "mesh.data=1", *accum)
    cfg = tiny_lm.make_cfg(*SCANNED, *extra)
    results = []
    for c, mesh in [(one_cfg, tiny_lm.single_device_mesh()), (cfg, mesh_lib.make_mesh(cfg.mesh))]:
        prepared, state, losses = tiny_lm.run_steps(c, mesh, 3)
        with activate(mesh, prepared.rules):
            results.append((losses, prepared.task.evaluate(state)["loss"]))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=2e-6)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=2e-6)


@pytest.mark.parametrize("pipe, ticks", [({"microbatches": 2}, 2 + 2 - 1),
                                         ({"microbatches": 2, "repeats": 2}, 4 + 2 - 1)])
def test_compiled_step_passes_activations_round_the_ring_of_stages(tiny_lm, pipe, ticks):
    """data=4 x stage=2: one collective-permute of a microbatch's activations (B/M, T, D) per tick forward and one
    (its gradient) backward, between the devices that differ only in their stage index."""
    cfg = tiny_lm.make_cfg(*SCANNED, "mesh.data=4", "mesh.stage=2", *(f"pipeline.{k}={v}" for k, v in pipe.items()))
    mesh = mesh_lib.make_mesh(cfg.mesh)
    step = build_step(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    with activate(mesh, step.rules):
        hlo = step.train_step.lower(step.abstract, abstract_batch(cfg, step.batch_sharding)).compile().as_text()
    permute = hlo_collectives.read_collectives(hlo)["collective-permute"]
    rows = cfg.train.batch_size // pipe["microbatches"] // 4  # per device: the microbatch split over data=4
    activation_bytes = rows * cfg.data.seq_len * cfg.model.d_model * 4
    assert permute.count >= 2 * ticks and permute.bytes >= 2 * ticks * activation_bytes, permute
    # Every pair is a hop along the stage axis: the same data index, the stage index one up (mod 2).
    index = {d.id: tuple(int(i) for i in np.argwhere(mesh.devices == d)[0]) for d in mesh.devices.flat}
    pairs = [tuple(map(int, p)) for g in re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", hlo)
             for p in re.findall(r"\{(\d+),(\d+)\}", g)]
    assert len(pairs) >= 16  # 8 devices each send forward and (the gradient) backward
    for src, dst in pairs:
        a, b = index[src], index[dst]  # (data, stage, fsdp, expert, tensor) of each end
        assert a[0] == b[0] and a[2:] == b[2:] and b[1] in ((a[1] + 1) % 2, (a[1] - 1) % 2), (a, b)


@pytest.mark.parametrize("extra, message", [
    (["model.layers=3"], r"model.layers=3 does not split into mesh.stage x pipeline.repeats = 2 equal groups"),
    (["pipeline.microbatches=3"], r"does not cut into 3 microbatches .* Fix: train.batch_size a multiple of 12"),
    (["pipeline.microbatches=4"], r"into 4 microbatches whose rows split evenly over the 4 data-parallel devices"),
    (["model.scan_layers=false"], r"model.scan_layers=false.*Fix: model.scan_layers=true"),
    (["pipeline.microbatches=1", "pipeline.repeats=2", "mesh.data=2", "mesh.stage=4", "model.layers=8"],
     r"Fix: pipeline.microbatches >= 4"),
    (["mesh.stage=1", "mesh.data=8"], r"with mesh.stage=1: there is no pipeline"),
    (["model.sliding_window=4", "model.layer_types=[sliding,full,sliding,full]"], r"mixes sliding and full layers"),
])
def test_layouts_the_axes_do_not_divide_are_config_errors(tiny_lm, extra, message):
    cfg = tiny_lm.make_cfg(*SCANNED, "mesh.data=4", "mesh.stage=2", "pipeline.microbatches=2", *extra)
    with pytest.raises(ConfigError, match=message):
        build_step(cfg, mesh_lib.make_mesh(cfg.mesh), make_tokenizer(cfg.data.tokenizer))


def test_bubble_fraction_and_the_stage_axis_in_the_mesh():
    assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)  # GPipe: (S-1)/(M+S-1)
    assert pipeline.bubble_fraction(4, 4, repeats=2) == pytest.approx(3 / 11)  # circular: (S-1)/(rM+S-1)
    assert pipeline.bubble_fraction(1, 8) == 0
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, stage=4))
    assert mesh_lib.describe(mesh) == "data=2 x stage=4 x fsdp=1 x tensor=1"
    # Outside the pipeline (embedding, head, loss) the stages hold different examples; inside, the same ones.
    assert mesh_lib.data_parallel_size(mesh) == 8


@pytest.mark.slow
def test_plan_shows_memory_per_device_falling_with_stages():
    """`systolic plan` for 4 GPUs: 4 stages hold a quarter of the 8 layers' weights and Adam moments each, where data
    parallelism holds them all; the plan notes the schedule and its bubble."""
    from tiny import TINY_LM

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUMPY_DTYPE_PROMOTION")}

    def plan(mesh: str, *extra: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "systolic", "plan", "lm", *TINY_LM, *SCANNED, "model.layers=8",
                               *extra, "--target", "h100", "--mesh", mesh, "--json"],
                              capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    data = plan("data=4")
    staged = plan("stage=4", "pipeline.microbatches=4")
    assert staged["mesh"] == "data=1 x stage=4 x fsdp=1 x tensor=1"
    assert staged["argument_bytes"] < 0.4 * data["argument_bytes"], (staged["argument_bytes"], data["argument_bytes"])
    assert "4 stages x 4 microbatches (GPipe): bubble (S-1)/(rM+S-1) = 42.9%" in " ".join(staged["notes"])


@pytest.mark.slow
def test_cli_trains_validates_and_samples_on_a_pipeline(corpus_dir, tmp_path):
    """The real entry point on data=4 x stage=2: training and validation pipelined, sampling unsplit."""
    from tiny import LM_CLI_QUIET, TINY_LM

    proc = subprocess.run([sys.executable, "-m", "systolic", "train", "lm", *TINY_LM, *LM_CLI_QUIET, *SCANNED,
                           f"data.path={corpus_dir}", "train.steps=2", "train.eval_every=2", "sample.max_new_tokens=8",
                           "mesh.data=4", "mesh.stage=2", "pipeline.microbatches=2",
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "mesh data=4 x stage=2" in out and "step 2: eval loss" in out and "sample (temperature" in out, out
