"""Images for the gan workload: scikit-learn's bundled digits or a folder of PNG/JPEG files, split once into a
training and a held-out set, and an epoch-shuffling batch iterator whose position is saved with checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from systolic.data.corpus import list_files
from systolic.errors import UserError
from systolic.workloads.gan.config import GANConfig

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
SPLIT_SEED = 20240607  # the held-out split is the same in every run, whatever train.seed is


@dataclasses.dataclass
class ImageSet:
    train_images: np.ndarray  # (N, size, size, C) float32 in [-1, 1]
    train_labels: np.ndarray  # (N,) int32; all 0 for unlabelled folders
    val_images: np.ndarray
    val_labels: np.ndarray
    labelled: bool
    source: str

    @property
    def channels(self) -> int:
        return int(self.train_images.shape[-1])


def load_images(cfg: GANConfig) -> ImageSet:
    if cfg.data.path:
        images, labels, labelled, source = *_read_folder(Path(cfg.data.path).expanduser(), cfg.image.size), False, cfg.data.path
    else:
        images, labels = _digits(cfg.image.size)
        labelled, source = True, "scikit-learn digits"
    order = np.random.default_rng(SPLIT_SEED).permutation(len(images))
    n_val = max(1, round(len(images) * cfg.data.val_percent / 100))
    val, train = order[:n_val], order[n_val:]
    return ImageSet(images[train], labels[train], images[val], labels[val], labelled, source)


def _digits(size: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0  # (1797, 8, 8) in [0, 1]
    if size != 8:
        from PIL import Image

        images = np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.BILINEAR)) for im in images])
    return (images[..., None] * 2 - 1).astype(np.float32), digits.target.astype(np.int32)


def _read_folder(root: Path, size: int) -> tuple[np.ndarray, np.ndarray]:
    if not root.is_dir():
        raise UserError(f"data.path={str(root)!r} is not a folder. Expected a folder of PNG/JPEG images (searched "
                        "recursively). Fix: pass an existing folder, or data.path='' for the bundled digits.")
    from PIL import Image

    files = list_files(root, suffixes=IMAGE_SUFFIXES)
    images = []
    for file in files:
        try:
            with Image.open(file) as im:
                images.append(_square(im.convert("RGB"), size))
        except OSError as e:
            raise UserError(f"Could not read the image {file}: {e}. Fix: remove or replace the file.") from e
    if len(images) < 2:
        raise UserError(f"data.path={str(root)!r} holds {len(images)} PNG/JPEG images; at least 2 are needed (one to "
                        "train on, one to hold out), and a GAN wants thousands. Fix: point data.path at a folder of images.")
    return np.stack(images), np.zeros(len(images), np.int32)


def _square(im: Any, size: int) -> np.ndarray:
    """Centre crop to a square, resize to size x size, scale to [-1, 1]: (size, size, 3) float32."""
    from PIL import Image

    w, h = im.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    im = im.crop((left, top, left + side, top + side)).resize((size, size), Image.BICUBIC)
    return np.asarray(im, np.float32) / 127.5 - 1.0


class BatchIterator:
    """Rows [lo, hi) of each global batch of a fresh permutation per epoch (seeded by seed and epoch), so any
    position can be recomputed from `{"epoch", "index"}`."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, *, global_batch: int, seed: int, lo: int, hi: int):
        if len(images) < global_batch:
            raise UserError(f"train.batch_size={global_batch} is larger than the {len(images)} training images. "
                            f"Fix: lower train.batch_size to at most {len(images)}.")
        self.images, self.labels = images, labels
        self.global_batch, self.seed, self.lo, self.hi = global_batch, seed, lo, hi
        self.epoch, self.index = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.images))

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.index + self.global_batch > len(self.images):  # drop the remainder, start a new epoch
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation()
        rows = self._order[self.index + self.lo:self.index + self.hi]
        self.index += self.global_batch
        return {"images": self.images[rows], "labels": self.labels[rows]}

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation()


def channels_for(cfg: GANConfig) -> int:
    """Digits are grey; folder images are read as RGB."""
    return 3 if cfg.data.path else 1
