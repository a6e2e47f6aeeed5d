"""What the CLI calls for the `gan` workload: train (then report and draw) and sample from a run directory."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from systolic import outfile
from systolic.config import check_seed
from systolic.engine import loop
from systolic.engine.run import Run
from systolic.plan.planner import StepProgram
from systolic.errors import UserError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate, rules_for
from systolic.workloads.gan.config import GANConfig
from systolic.workloads.gan.pictures import plot_curves, save_grid



def train(cfg: GANConfig, run_dir: Path, quiet: bool = False) -> loop.RunResult:
    from systolic.workloads.gan.task import build_task

    run_dir = Path(run_dir)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    run = Run.start(cfg, steps=cfg.train.steps, eval_every=cfg.train.eval_every, quiet=quiet)
    say = run.say
    prepared = build_task(cfg, mesh, run_dir)
    images, refs = prepared.images, prepared.references
    say(f"gan: {prepared.param_count / 1e6:.2f}M parameters (G + D), {cfg.image.size}x{cfg.image.size}x"
        f"{images.channels}, loss {cfg.gan.loss}, d_steps {cfg.gan.d_steps}, spectral norm "
        f"{'on' if cfg.model.spectral_norm else 'off'}, {'conditional' if cfg.gan.conditional else 'unconditional'}; "
        f"mesh {mesh_lib.describe(mesh)} ({jax.device_count()} {jax.default_backend()} devices)")
    say(f"data: {images.source}: {len(images.train_images):,} train / {len(images.val_images):,} held-out images; "
        f"run directory {run_dir}")
    if refs:
        say(f"evaluation classifier: {refs['classifier_accuracy']:.1%} accuracy on the held-out split. Fréchet "
            f"classifier distance references: real vs held-out {refs['frechet_floor']:.3f} (floor), untrained "
            f"generator {refs['frechet_ceiling']:.2f}, uniform noise {refs['frechet_noise']:.2f} (ceilings)")
    else:
        say("evaluation: the images have no labels, so no classifier scores; every evaluation writes a sample grid")
    with activate(mesh, prepared.rules):
        result = run.loop(prepared.task, run_dir)
    if jax.process_index() == 0 and cfg.observe.plot:
        plot_curves(run_dir)
    if run.stopped(result):
        return result
    ev = result.eval_metrics
    if ev and refs:
        say(f"Fréchet classifier distance {ev['frechet']:.3f} = {ev['frechet'] / refs['frechet_floor']:.2f}x the "
            f"real-vs-real floor ({refs['frechet_floor']:.3f}), {refs['frechet_ceiling'] / ev['frechet']:.0f}x below "
            f"the untrained generator ({refs['frechet_ceiling']:.2f}); {ev['confident']:.1%} of samples classified with "
            f"confidence >= 0.9 (real held-out images: {refs['confident_real']:.1%})")
    run.say_throughput(result, "img/s")
    say(f"pictures: {run_dir / 'samples.png'}, {run_dir / 'curves.png'}")
    return result


def sample(run_dir: Path, count: int = 64, out: Path | None = None, seed: int = 0, force: bool = False) -> Path:
    """Draws `count` images from the EMA generator of the run's latest intact checkpoint into a PNG grid."""
    from systolic.engine import finished
    from systolic.workloads.gan.data import channels_for
    from systolic.workloads.gan.train import make_networks, make_sampler, make_state_fns

    if count < 1:
        raise UserError(f"--count {count} must be at least 1. Fix: e.g. --count 64.")
    check_seed("--seed", seed)
    run_dir = Path(run_dir)
    if out is not None:  # the default, RUN_DIR/sample.png, is this command's own file
        outfile.check(out, option="--out", suffixes=(".png",), force=force)
    with finished.open_run(run_dir, GANConfig, "systolic sample gan") as run:
        cfg: GANConfig = run.cfg
        channels = channels_for(cfg)
        mesh = mesh_lib.make_mesh(type(cfg.mesh)(data=1), jax.devices()[:1])
        _, abstract, _ = make_state_fns(cfg, channels, mesh, rules_for(cfg.sharding.rules, mesh))
        state = run.restore(abstract)
    images = make_sampler(make_networks(cfg, channels), max(count, 64))(
        state.extra["ema"], state.extra["batch_stats"]["g"], jax.random.PRNGKey(seed))
    return save_grid(np.asarray(images)[:count], Path(out) if out else run_dir / "sample.png")


def plan(cfg: GANConfig, devices: list) -> StepProgram:
    """The real train step (`gan.d_steps` discriminator updates, one generator update, the EMA) lowered from
    abstract inputs on a mesh of `devices`, for `systolic plan`."""
    from systolic.workloads.gan.data import channels_for
    from systolic.workloads.gan.flops import train_flops_per_step
    from systolic.workloads.gan.task import PEAK_DTYPE, make_step
    from systolic.engine.state import param_count

    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    channels, size, rows = channels_for(cfg), cfg.image.size, cfg.train.batch_size
    rules, _, _, abstract, batch_shard, train_step = make_step(cfg, channels, mesh)
    batch = {"images": jax.ShapeDtypeStruct((rows, size, size, channels), jax.numpy.float32, sharding=batch_shard),
             "labels": jax.ShapeDtypeStruct((rows,), jax.numpy.int32, sharding=batch_shard)}
    with activate(mesh, rules):
        lowered = train_step.lower(abstract, batch)
    return StepProgram(lowered=lowered, argument_bytes=mesh_lib.bytes_per_device((abstract, batch)),
                       params=param_count(abstract.params), items_per_step=rows, item_unit="img",
                       model_flops_per_step=train_flops_per_step(cfg, channels), dtype=PEAK_DTYPE,
                       notes=("model FLOPs: the convolutions' and dense layers' multiply-adds with image pixels "
                              "(workloads/gan/flops.py); float32 networks, counted against the bfloat16 peak: on a "
                              "TPU, JAX's default precision runs float32 convolutions as one bfloat16 pass",))
