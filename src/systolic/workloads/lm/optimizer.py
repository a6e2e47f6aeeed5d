"""The lm's optimizer: AdamW (`optim.name=adamw`), or Muon for the hidden matrices and AdamW for the rest
(`optim.name=muon`), each parameter sorted by its role (lm/model/parametrization.py); under muP, AdamW's per-layer
learning rates.

Muon's step on a matrix is muon_lr * (orthogonalised momentum) * shape factor, plus AdamW's decoupled decay
lr * weight_decay * W, so switching optimizers leaves the regularisation as it was. Both follow one schedule
shape: Muon's rate is AdamW's times muon_lr / lr at every step (warmup, cosine decay).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from systolic.optim import muon
from systolic.optim.adamw import adamw, make_optimizer, standard_promotion
from systolic.workloads.lm.config import LMOptimConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.parametrization import adam_lr_multiplier, muon_dims, roles


def make_lm_optimizer(cfg: LMOptimConfig, model: ModelConfig, schedule: optax.Schedule, *,
                      muon_transform: optax.GradientTransformation | None = None) -> optax.GradientTransformation:
    """Clipping of the global gradient norm, then the optimizer that `cfg.name` names, for `model`'s
    parametrization, at the rate lr(t) = `schedule(t)` (optim/adamw.py `make_schedule`, built once by the caller: the
    train step logs the same). `muon_transform`: what orthogonalises the hidden matrices' updates under Muon (default
    optim/muon.py's; benchmarks/studies/muon_collectives.py passes Optax's to compare their collectives)."""
    mup = model.parametrization == "mup"
    moment_dtype = jnp.dtype(cfg.moment_dtype)
    if cfg.name == "adamw" and not mup:
        return make_optimizer(cfg, schedule, moment_dtype=moment_dtype)  # the engine's, as sim uses it
    adam = adamw(cfg, schedule, moment_dtype=moment_dtype)
    if cfg.name == "adamw":
        # muP: lr / m for the hidden weights. The whole update (decay included, as the mup package's MuAdamW
        # scales its parameter groups' lr) is scaled: AdamW's update is linear in its learning rate.
        return standard_promotion(optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adam,
                                              scale_per_parameter(lambda path: adam_lr_multiplier(path, model))))
    muon_step = optax.chain(
        muon_transform or muon.scale_by_muon(muon_dims, momentum=cfg.muon_momentum,
                                             rule="spectral" if mup else "keller", moment_dtype=moment_dtype),
        optax.scale(cfg.muon_lr / cfg.lr),  # then the decay, then both times -lr(t): see the module docstring
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    # Under muP the parameters AdamW keeps beside Muon (embeddings, output layer, norms, biases) keep their
    # learning rate: no multipliers.
    return standard_promotion(optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.partition({"muon": muon_step, "adamw": adam}, _labels),
    ))


def _labels(params):
    """"muon" for the hidden matrices, "adamw" for the rest."""
    return jax.tree.map(lambda r: "muon" if r == "hidden" else "adamw", roles(params))


def scale_per_parameter(factor) -> optax.GradientTransformation:
    """Multiplies each parameter's update by `factor(key path)`, a Python float."""

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(lambda path, u: u * factor(path), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)
