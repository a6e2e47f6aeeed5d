"""The `gan` workload's state, losses and jitted step, and the `Task` it hands the engine's loop.

State layout (one `TrainState` pytree): params = {"g", "d"}; opt_state = {"g", "d"} (two Adam optimizers);
extra = {"ema": generator weights averaged over steps, "batch_stats": {"g": BatchNorm statistics[, "d":
spectral-norm vectors]}}. Every parameter is replicated (the networks are small); the batch is split over the
mesh's data axes, so the step is plain data parallelism and XLA inserts the gradient all-reduces.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.optim.adamw import standard_promotion
from systolic.engine.state import TrainState, make_sharded_state
from systolic.runtime import memory
from systolic.runtime.sharding import Rules, activate
from systolic.workloads.gan.config import GANConfig
from systolic.workloads.gan.evaluate import HIDDEN
from systolic.workloads.gan.model import NUM_CLASSES, Discriminator, Generator, num_upsamples


@dataclasses.dataclass(frozen=True)
class Networks:
    """Structure (no weights) of both networks: what `nnx.merge` needs inside jitted code."""

    g: nnx.GraphDef
    d: nnx.GraphDef
    latent_dim: int
    conditional: bool


def make_models(cfg: GANConfig, channels: int, key: jax.Array) -> tuple[Generator, Discriminator]:
    g_key, d_key = jax.random.split(key)
    g = Generator(cfg.model, cfg.image.size, channels, conditional=cfg.gan.conditional, rngs=nnx.Rngs(params=g_key))
    d = Discriminator(cfg.model, cfg.image.size, channels, conditional=cfg.gan.conditional, rngs=nnx.Rngs(params=d_key))
    return g, d


def make_networks(cfg: GANConfig, channels: int) -> Networks:
    g, d = nnx.eval_shape(lambda: make_models(cfg, channels, jax.random.PRNGKey(0)))
    return Networks(g=nnx.graphdef(g), d=nnx.graphdef(d), latent_dim=cfg.model.latent_dim, conditional=cfg.gan.conditional)


def _split(module: nnx.Module) -> tuple[Any, Any]:
    """(parameters, non-trained state) as plain nested dicts."""
    _, params, stats = nnx.split(module, nnx.Param, nnx.BatchStat)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(stats)


def _run(graphdef: nnx.GraphDef, params: Any, stats: Any, *args: Any, train: bool) -> tuple[jax.Array, Any]:
    """Calls a network on `args`; returns its output and its updated non-trained state."""
    module = nnx.merge(graphdef, params, stats)
    out = module(*args, train=train)
    return out, nnx.to_pure_dict(nnx.state(module, nnx.BatchStat))


def make_optimizers(cfg: GANConfig) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
    def adam(lr: float) -> optax.GradientTransformation:
        return standard_promotion(optax.chain(optax.clip_by_global_norm(cfg.optim.clip_norm),
                                              optax.adam(lr, b1=cfg.optim.b1, b2=cfg.optim.b2, eps=cfg.optim.eps)))

    return adam(cfg.optim.lr), adam(cfg.optim.lr * cfg.gan.d_lr_scale)


def make_state_fns(cfg: GANConfig, channels: int, mesh: Mesh, rules: Rules):
    """Returns (init_state, abstract_state, state_shardings); the state is born replicated on the mesh."""
    tx_g, tx_d = make_optimizers(cfg)

    def make_state(key: jax.Array) -> TrainState:
        init_key, rng = jax.random.split(key)
        g, d = make_models(cfg, channels, init_key)
        (g_params, g_stats), (d_params, d_stats) = _split(g), _split(d)
        params = {"g": g_params, "d": d_params}
        batch_stats = {"g": g_stats} | ({"d": d_stats} if jax.tree.leaves(d_stats) else {})
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state={"g": tx_g.init(g_params), "d": tx_d.init(d_params)}, rng=rng,
                          extra={"ema": jax.tree.map(jnp.copy, g_params), "batch_stats": batch_stats})

    replicated = NamedSharding(mesh, P())
    state = make_sharded_state(make_state, (jax.random.PRNGKey(cfg.train.seed),),
                               lambda abstract: jax.tree.map(lambda _: replicated, abstract), lambda: activate(mesh, rules))
    check_fits(cfg, channels, state.abstract, mesh)  # the shapes are known; nothing is allocated yet
    return state.init, state.abstract, state.shardings


def check_fits(cfg: GANConfig, channels: int, abstract: TrainState, mesh: Mesh) -> None:
    """A UserError when the state (networks, optimizer moments, EMA) plus an evaluation's generated images cannot fit
    in the mesh's memory, before anything is allocated."""
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    m = cfg.model
    images = cfg.gan.eval_samples * sample_floats(cfg, channels) * 4
    memory.check_fits(
        state_bytes + images, list(mesh.devices.flat),
        what=(f"This gan (model.g_channels={m.g_channels}, model.d_channels={m.d_channels}, model.latent_dim="
              f"{m.latent_dim}, gan.eval_samples={cfg.gan.eval_samples} images of {cfg.image.size}^2 generated in "
              "one batch, with every activation it keeps)"),
        fix="lower the model's channels or gan.eval_samples, or use more devices.",
    )


def sample_floats(cfg: GANConfig, channels: int) -> int:
    """float32 values (or their bytes' worth) an evaluation holds per generated image. The sampler generates all
    gan.eval_samples in one batch, keeping several copies of each generator feature map (the layer's output,
    normalised by train-mode BatchNorm, activated, and XLA's convolution buffers); the image is on the device, on
    the host and on the device again for the classifier; then the classifier's hidden layers, its features on the
    device and the host and twice in float64 for the covariance, and its logits, probabilities and their host copy.
    The copies of the maps are fitted to peak RSS (2026-12-06, 8x8 digits): model.g_channels=32, 40,000 to 160,000
    samples, 22.2 KiB more per image (this count: 24.4 KiB); the default g_channels=128, 30,000 samples, about
    120 KiB per image (this count: 123 KiB)."""
    width, n_up = cfg.model.g_channels, num_upsamples(cfg.image.size)
    # The projection (4, 4, width), then each upsampling's (2H, 2W, C/2).
    maps = 16 * width + sum((4 * 2 ** (i + 1)) ** 2 * max(width // 2 ** (i + 1), 16) for i in range(n_up))
    copies = 3 + width / 64  # the measured copies grow with the channels (3.1 at width 32, 4.9 at 128)
    features = HIDDEN[-1]
    classifier = sum(HIDDEN) + features + 2 * 2 * features + 3 * NUM_CLASSES
    return math.ceil(copies * maps) + 3 * cfg.image.size**2 * channels + classifier


# LOSSES -------------------------------------------------------------------------------------------------------


def discriminator_loss(kind: str, real_logits: jax.Array, fake_logits: jax.Array) -> jax.Array:
    if kind == "hinge":
        return jax.nn.relu(1 - real_logits).mean() + jax.nn.relu(1 + fake_logits).mean()
    # non-saturating GAN: -log sigmoid(real) - log(1 - sigmoid(fake)), written with softplus for stability
    return jax.nn.softplus(-real_logits).mean() + jax.nn.softplus(fake_logits).mean()


def generator_loss(kind: str, fake_logits: jax.Array) -> jax.Array:
    if kind == "hinge":
        return -fake_logits.mean()
    return jax.nn.softplus(-fake_logits).mean()  # -log sigmoid(fake): strong gradients while D wins


# THE STEP -----------------------------------------------------------------------------------------------------


def make_train_step(cfg: GANConfig, nets: Networks):
    """`train_step(state, batch) -> (state, metrics)`: `gan.d_steps` discriminator updates on the batch with fresh
    noise each, then one generator update, then the EMA. BatchNorm normalises with the statistics of the whole
    global batch: under jit with the batch sharded over devices, the mean over the batch axis is the global mean
    (XLA inserts the all-reduce), so 8 devices compute what 1 device does."""
    tx_g, tx_d = make_optimizers(cfg)
    kind = cfg.gan.loss

    def generate(g_params, g_stats, key, labels, rows):
        z = jax.random.normal(key, (rows, nets.latent_dim))  # (B, latent)
        return _run(nets.g, g_params, g_stats, z, labels if nets.conditional else None, train=True)

    def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        real, labels = batch["images"], batch["labels"]  # (B, H, W, C), (B,)
        rows = real.shape[0]
        keys = jax.random.split(state.rng, cfg.gan.d_steps + 2)
        g_params, d_params = state.params["g"], state.params["d"]
        g_stats = state.extra["batch_stats"]["g"]
        d_stats = state.extra["batch_stats"].get("d", {})
        opt_g, opt_d = state.opt_state["g"], state.opt_state["d"]
        cond = labels if nets.conditional else None

        # DISCRIMINATOR UPDATES
        def d_loss_fn(d_params, d_stats, fake):
            both = jnp.concatenate([real, fake])  # (2B, H, W, C): one pass, one spectral-norm iteration
            logits, d_stats = _run(nets.d, d_params, d_stats, both, None if cond is None else jnp.concatenate([cond, cond]), train=True)
            real_logits, fake_logits = logits[:rows], logits[rows:]
            return discriminator_loss(kind, real_logits, fake_logits), (d_stats, real_logits.mean(), fake_logits.mean())

        for i in range(cfg.gan.d_steps):
            fake, _ = generate(g_params, g_stats, keys[i], labels, rows)  # G's statistics update in its own step
            (d_loss, (d_stats, d_real, d_fake)), grads = jax.value_and_grad(d_loss_fn, has_aux=True)(
                d_params, d_stats, jax.lax.stop_gradient(fake))
            updates, opt_d = tx_d.update(grads, opt_d, d_params)
            d_params = optax.apply_updates(d_params, updates)

        # GENERATOR UPDATE
        def g_loss_fn(g_params):
            fake, new_g_stats = generate(g_params, g_stats, keys[-2], labels, rows)
            logits, _ = _run(nets.d, d_params, d_stats, fake, cond, train=False)  # D's state is not advanced here
            return generator_loss(kind, logits), new_g_stats

        (g_loss, g_stats), grads = jax.value_and_grad(g_loss_fn, has_aux=True)(g_params)
        updates, opt_g = tx_g.update(grads, opt_g, g_params)
        g_params = optax.apply_updates(g_params, updates)

        # EMA: the decay ramps up from 0 so that early samples are not dominated by the random initialisation.
        step = state.step + 1
        step_f = step.astype(jnp.float32)
        decay = jnp.minimum(cfg.gan.ema, (1.0 + step_f) / (10.0 + step_f))
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, state.extra["ema"], g_params)
        batch_stats = {"g": g_stats} | ({"d": d_stats} if "d" in state.extra["batch_stats"] else {})
        new_state = TrainState(step=step, params={"g": g_params, "d": d_params}, opt_state={"g": opt_g, "d": opt_d},
                               rng=keys[-1], extra={"ema": ema, "batch_stats": batch_stats})
        return new_state, {"loss": g_loss, "g_loss": g_loss, "d_loss": d_loss, "d_real_logit": d_real, "d_fake_logit": d_fake}

    return train_step


def make_sampler(nets: Networks, count: int):
    """`sample(g_params, g_stats, key) -> (count, H, W, C)` images in [-1, 1]. BatchNorm normalises with the
    statistics of the sample batch itself (count >= 64), as during training, rather than with the running
    averages, which belong to the live weights rather than to their EMA. Conditional models draw the classes in
    turn (0, 1, ..., 9, 0, ...)."""
    labels = jnp.arange(count) % 10

    @jax.jit
    def sample(g_params, g_stats, key):
        z = jax.random.normal(key, (count, nets.latent_dim))
        images, _ = _run(nets.g, g_params, g_stats, z, labels if nets.conditional else None, train=True)
        return images

    return sample
