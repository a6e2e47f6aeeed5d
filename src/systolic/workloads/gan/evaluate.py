"""Evaluation you can check: a small classifier trained on the real training split provides penultimate-layer
features and class confidences for generated images.

- "Fréchet classifier distance" (FCD): the Fréchet distance between Gaussians fitted to the classifier's
  penultimate features on generated and on held-out real images. It is Inception FID's formula on a much
  smaller feature extractor trained on this data set, so its values are not comparable with published FIDs.
- "confident": the fraction of generated images the classifier assigns some class with probability >= 0.9.

Reference points, computed the same way: real training images vs held-out (the floor: what a perfect
generator would score with this many samples) and an untrained generator vs held-out (the ceiling).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from systolic import safe_npy
from systolic.errors import UserError
from systolic.optim.adamw import standard_promotion

CLASSIFIER_FILE = "classifier.npz"
CONFIDENCE = 0.9
HIDDEN = (256, 64)  # the second hidden layer (64 features) is the penultimate layer


def frechet_distance(features_a: np.ndarray, features_b: np.ndarray) -> float:
    """||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2)) in float64, features (N, D).

    tr((S_a S_b)^(1/2)) = sum of sqrt(eigenvalues of S_a^(1/2) S_b S_a^(1/2)): that matrix is symmetric
    positive semi-definite, so `eigh` is stable where a general matrix square root can turn complex."""
    a, b = np.asarray(features_a, np.float64), np.asarray(features_b, np.float64)
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(cov_a)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T  # S_a^(1/2)
    inner = np.linalg.eigvalsh(root_a @ cov_b @ root_a)
    trace_sqrt = np.sqrt(np.clip(inner, 0, None)).sum()
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2 * trace_sqrt)


# THE CLASSIFIER -----------------------------------------------------------------------------------------------


def init_classifier(key: jax.Array, in_dim: int, classes: int) -> dict[str, Any]:
    sizes = (in_dim, *HIDDEN, classes)
    keys = jax.random.split(key, len(sizes) - 1)
    return {f"layer{i}": {"w": jax.random.normal(k, (m, n)) * np.sqrt(2.0 / m), "b": jnp.zeros(n)}
            for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def classifier_apply(params: dict[str, Any], images: jax.Array) -> tuple[jax.Array, jax.Array]:
    """images (B, H, W, C) -> (penultimate features (B, 64), logits (B, classes))."""
    h = images.reshape(images.shape[0], -1)  # (B, H * W * C)
    n = len(params)
    for i in range(n - 1):
        h = jax.nn.relu(h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"])
    return h, h @ params[f"layer{n - 1}"]["w"] + params[f"layer{n - 1}"]["b"]


def train_classifier(images: np.ndarray, labels: np.ndarray, *, steps: int = 1500, seed: int = 0) -> dict[str, Any]:
    """Adam on minibatches with small Gaussian input noise (robustness to generator artefacts)."""
    classes = int(labels.max()) + 1
    key = jax.random.PRNGKey(seed)
    params = init_classifier(key, int(np.prod(images.shape[1:])), classes)
    tx = standard_promotion(optax.adamw(1e-3, weight_decay=1e-4))
    x_all, y_all = jnp.asarray(images), jnp.asarray(labels)

    @jax.jit
    def step(params, opt_state, key):
        key_rows, key_noise = jax.random.split(key)
        rows = jax.random.randint(key_rows, (128,), 0, x_all.shape[0])
        x = x_all[rows] + 0.1 * jax.random.normal(key_noise, x_all[rows].shape)

        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(classifier_apply(p, x)[1], y_all[rows]).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for key in jax.random.split(jax.random.PRNGKey(seed + 1), steps):
        params, opt_state = step(params, opt_state, key)
    return jax.device_get(params)


def load_or_train_classifier(run_dir: Path, images: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """Cached in the run directory so every evaluation (and a resumed run) uses the same classifier."""
    path = Path(run_dir) / CLASSIFIER_FILE
    if path.exists():
        return read_classifier(path, int(np.prod(images.shape[1:])), int(labels.max()) + 1)
    params = train_classifier(images, labels)
    if jax.process_index() == 0:
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **{f"{name}.{k}": np.asarray(v) for name, layer in params.items() for k, v in layer.items()})
        tmp.replace(path)
    return params


def read_classifier(path: Path, in_dim: int, classes: int) -> dict[str, Any]:
    """The cached classifier at `path`, whose layers must have the shapes `init_classifier(in_dim, classes)` gives
    and finite float values; a UserError naming the file otherwise (it is a cache: deleting it retrains it)."""
    sizes = (in_dim, *HIDDEN, classes)
    shapes = {f"layer{i}.{k}": shape for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))
              for k, shape in (("w", (m, n)), ("b", (n,)))}
    listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
    expected = f"the gan run's cached evaluation classifier, a .npz of float arrays {listed}"
    fix = (f"delete {path}; the next run or evaluation trains it again from the same seed (about a minute on a CPU), "
           "so the scores stay comparable.")
    flat = safe_npy.read_arrays(path, shapes, kind="f", expected=expected, fix=fix)
    if bad := [name for name, array in flat.items() if not np.isfinite(array).all()]:
        raise UserError(f"Could not use {path}: its {bad[0]} holds NaN or Inf. Expected {expected}. Fix: {fix}")
    return {f"layer{i}": {"w": flat[f"layer{i}.w"].astype(np.float32), "b": flat[f"layer{i}.b"].astype(np.float32)}
            for i in range(len(sizes) - 1)}


# SCORING ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Scorer:
    """Scores a set of images against the held-out real images."""

    params: dict[str, Any]
    val_features: np.ndarray

    @classmethod
    def make(cls, params: dict[str, Any], val_images: np.ndarray) -> "Scorer":
        scorer = cls(params, np.zeros(0))
        scorer.val_features = scorer.features(val_images)[0]
        return scorer

    def features(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feats, logits = jax.jit(classifier_apply)(self.params, jnp.asarray(images, jnp.float32))
        return np.asarray(feats), np.asarray(jax.nn.softmax(logits))

    def score(self, images: np.ndarray) -> dict[str, float]:
        feats, probs = self.features(images)
        return {"frechet": frechet_distance(feats, self.val_features),
                "confident": float((probs.max(-1) >= CONFIDENCE).mean())}

    def accuracy(self, images: np.ndarray, labels: np.ndarray) -> float:
        return float((self.features(images)[1].argmax(-1) == labels).mean())
