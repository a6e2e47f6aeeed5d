"""The `Task` the gan workload hands the engine's loop: data, state functions, the jitted step and evaluation."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from systolic.data.stream import DeviceStream
from systolic.engine.loop import Task
from systolic.engine.step import jit_step
from systolic.engine.state import TrainState, param_count
from systolic.observe.peak_flops import peak_flops
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import Rules, logical_to_spec, rules_for
from systolic.workloads.gan import evaluate as eval_lib
from systolic.workloads.gan.config import GANConfig
from systolic.workloads.gan.data import BatchIterator, ImageSet, load_images
from systolic.workloads.gan.flops import train_flops_per_step
from systolic.workloads.gan.pictures import image_grid, save_grid
from systolic.workloads.gan.train import (Networks, make_models, make_networks, make_sampler, make_state_fns,
                                          make_train_step)

CHECKED = ("d_loss", "g_loss")  # both networks' losses; the guard also checks every parameter of both
GRID_COUNT = 64
# The peak the MFU is measured against. The networks are float32, but JAX's default matmul precision runs float32
# convolutions on a TPU as one bfloat16 pass of the matrix unit (TF32 on recent NVIDIA GPUs, half bfloat16's rate:
# there the MFU reads low), so the bfloat16 peak is the rate the step could reach.
PEAK_DTYPE = "bfloat16"
EVAL_SEED = 1234  # evaluation noise is fixed, so a resumed run evaluates identically


@dataclasses.dataclass
class BuiltGANTask:
    """What `build_task` returns: the engine's `Task`, and beside it what the entry reports (sizes, the data, the
    evaluation's reference scores)."""

    task: Task
    mesh: Mesh
    rules: Rules
    images: ImageSet
    nets: Networks
    param_count: int
    references: dict[str, float]  # floor and ceiling of the evaluation metrics; empty without labels


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch",), rules))  # leading axis only; pixels stay whole


def make_step(cfg: GANConfig, channels: int, mesh: Mesh):
    """(rules, nets, init_state, abstract_state, batch_sharding, train_step): the jitted step on `mesh`."""
    rules = rules_for(cfg.sharding.rules, mesh)
    mesh_lib.check_batch(cfg.train.batch_size, 1, mesh)
    nets = make_networks(cfg, channels)
    init, abstract, shardings = make_state_fns(cfg, channels, mesh, rules)
    batch_shard = batch_sharding(mesh, rules)
    train_step = jit_step(make_train_step(cfg, nets), state_shardings=shardings, batch_sharding=batch_shard, mesh=mesh,
                          loop=cfg.loop, check=CHECKED)
    return rules, nets, init, abstract, batch_shard, train_step


def build_task(cfg: GANConfig, mesh: Mesh, run_dir: Path | None) -> BuiltGANTask:
    """`run_dir` None: no evaluation (tests)."""
    images = load_images(cfg)
    rules, nets, init, abstract, batch_shard, train_step = make_step(cfg, images.channels, mesh)
    # Each process reads only the rows of the global batch that its devices hold.
    lo, hi = mesh_lib.local_rows(batch_shard, cfg.train.batch_size)
    iterator = BatchIterator(images.train_images, images.train_labels, global_batch=cfg.train.batch_size,
                             seed=cfg.train.seed, lo=lo, hi=hi)
    evaluate, references = None, {}
    if run_dir is not None:
        evaluate, references = make_evaluate(cfg, nets, images, run_dir)
    peak = peak_flops(dtype=PEAK_DTYPE)  # None on a CPU (no data-sheet peak): then the log shows no MFU
    task = Task(
        workload="gan", abstract_state=abstract, init_state=init, train_step=train_step,
        data=DeviceStream(iterator, batch_shard, cfg.train.batch_size), check=CHECKED, evaluate=evaluate,
        nonfinite_advice=("lower optim.lr, gan.d_lr_scale or optim.clip_norm, then rerun the same command to "
                          "resume; or set loop.nonfinite=skip to drop such steps and go on"),
        items_per_step=cfg.train.batch_size, item_unit="images",
        flops_per_step=train_flops_per_step(cfg, images.channels),
        peak_flops=peak * jax.device_count() if peak else None,
        meta={"workload": "gan", "channels": images.channels, "image_size": cfg.image.size},
    )
    return BuiltGANTask(task=task, mesh=mesh, rules=rules, images=images, nets=nets,
                        param_count=param_count(abstract.params), references=references)


def make_evaluate(cfg: GANConfig, nets: Networks, images: ImageSet, run_dir: Path):
    """Every evaluation writes a sample grid (PNG + TensorBoard); with labelled data it also scores
    `gan.eval_samples` images from the EMA generator against the held-out split."""
    sampler = make_sampler(nets, max(cfg.gan.eval_samples, GRID_COUNT))
    key = jax.random.PRNGKey(EVAL_SEED)
    scorer = references = None
    if images.labelled:
        classifier = eval_lib.load_or_train_classifier(run_dir, images.train_images, images.train_labels)
        scorer = eval_lib.Scorer.make(classifier, images.val_images)
        references = reference_points(cfg, nets, images, scorer, sampler, key)
    tb = _image_writer(cfg, run_dir)

    def evaluate(state: TrainState) -> dict[str, float]:
        samples = np.asarray(jax.device_get(sampler(state.extra["ema"], state.extra["batch_stats"]["g"], key)))
        step = int(jax.device_get(state.step))
        if jax.process_index() == 0:
            save_grid(samples[:GRID_COUNT], Path(run_dir) / "samples" / f"step_{step:06d}.png")
            save_grid(samples[:GRID_COUNT], Path(run_dir) / "samples.png")
            if tb is not None:
                tb.add_image("samples", image_grid(samples[:GRID_COUNT]), step, dataformats="HWC")
                tb.flush()
        if scorer is None:
            return {}
        scores = scorer.score(samples[:cfg.gan.eval_samples])
        return scores | {"frechet_floor": references["frechet_floor"], "frechet_ceiling": references["frechet_ceiling"]}

    return evaluate, references or {}


def reference_points(cfg: GANConfig, nets: Networks, images: ImageSet, scorer: eval_lib.Scorer, sampler: Any,
                     key: jax.Array) -> dict[str, float]:
    """The same scores for: real training images (floor), an untrained generator and uniform noise (ceilings),
    each with as many images as an evaluation generates (at most the training set)."""
    n = min(cfg.gan.eval_samples, len(images.train_images))
    rows = np.random.default_rng(EVAL_SEED).choice(len(images.train_images), n, replace=False)
    real = scorer.score(images.train_images[rows])
    g, _ = make_models(cfg, images.channels, jax.random.PRNGKey(cfg.train.seed + 1))
    _, g_params, g_stats = nnx.split(g, nnx.Param, nnx.BatchStat)
    untrained = scorer.score(np.asarray(sampler(nnx.to_pure_dict(g_params), nnx.to_pure_dict(g_stats), key))[:n])
    noise = scorer.score(np.random.default_rng(EVAL_SEED).uniform(-1, 1, (n, *images.train_images.shape[1:])))
    return {"frechet_floor": real["frechet"], "confident_real": real["confident"],
            "frechet_ceiling": untrained["frechet"], "confident_untrained": untrained["confident"],
            "frechet_noise": noise["frechet"], "classifier_accuracy": scorer.accuracy(images.val_images, images.val_labels)}


def _image_writer(cfg: GANConfig, run_dir: Path):
    if not cfg.observe.tensorboard or jax.process_index() != 0:
        return None
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(Path(run_dir) / "tensorboard"), filename_suffix=".samples")
