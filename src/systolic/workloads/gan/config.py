"""The `gan` workload's config: model, data, image and GAN sections plus the engine's common sections."""

from __future__ import annotations

import dataclasses
from typing import Literal

from systolic.config import (AdamConfig, CheckpointConfig, LoopConfig, MeshConfig, ObserveConfig, ShardingConfig,
                             TrainConfig, check_positive)
from systolic.errors import ConfigError

IMAGE_SIZES = (8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """DCGAN widths: `g_channels`/`d_channels` at the 4x4 (generator start / discriminator end) resolution,
    halved (G) or doubled (D) per factor-2 resolution step."""

    latent_dim: int = 32
    g_channels: int = 128
    d_channels: int = 64
    spectral_norm: bool = False  # spectral normalisation of the discriminator's weights (one power iteration per step)

    def validate(self) -> None:
        check_positive(self, "model", ("latent_dim", "g_channels", "d_channels"))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Images to train on. An empty `path` means scikit-learn's bundled 8x8 handwritten digits (1,797 images,
    with labels); otherwise a folder of PNG/JPEG files (no labels)."""

    path: str = ""
    val_percent: float = 20.0  # held out for evaluation, chosen by a fixed permutation (the same in every run)

    def validate(self) -> None:
        if not 0 < self.val_percent < 100:
            raise ConfigError(f"data.val_percent={self.val_percent} must be between 0 and 100 (exclusive). Fix: e.g. data.val_percent=20.")


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    size: int = 8  # square images, resized and centre-cropped to this many pixels

    def validate(self) -> None:
        if self.size not in IMAGE_SIZES:
            raise ConfigError(f"image.size={self.size} is not supported; the DCGAN networks double or halve the "
                              f"resolution from 4x4, so the size must be one of {', '.join(map(str, IMAGE_SIZES))}. "
                              "Fix: e.g. image.size=32.")


@dataclasses.dataclass(frozen=True)
class GANSection:
    loss: Literal["nonsat", "hinge"] = "nonsat"
    d_steps: int = 1  # discriminator updates per generator update (each on the same real batch, fresh noise)
    ema: float = 0.999  # decay of the generator-weight average used for sampling and evaluation; 0 = off
    conditional: bool = False  # class-conditional G (label embedding) and projection D; needs labelled data
    d_lr_scale: float = 1.0  # discriminator learning rate = optim.lr * d_lr_scale
    eval_samples: int = 512  # generated images per evaluation; sample grids are written at every evaluation

    def validate(self) -> None:
        if self.d_steps < 1:
            raise ConfigError(f"gan.d_steps={self.d_steps} must be at least 1. Fix: e.g. gan.d_steps=1 (or 2-5 with gan.loss=hinge).")
        if not 0 <= self.ema < 1:
            raise ConfigError(f"gan.ema={self.ema} must be in [0, 1). Fix: e.g. gan.ema=0.999, or 0 to sample the live generator.")
        if self.d_lr_scale <= 0 or self.eval_samples <= 0:
            raise ConfigError(f"gan.d_lr_scale={self.d_lr_scale} and gan.eval_samples={self.eval_samples} must be "
                              "greater than 0. Fix: e.g. gan.d_lr_scale=1 gan.eval_samples=512.")


@dataclasses.dataclass(frozen=True)
class GANConfig:
    workload: Literal["gan"] = "gan"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    image: ImageConfig = ImageConfig()
    gan: GANSection = GANSection()
    train: TrainConfig = TrainConfig()
    loop: LoopConfig = LoopConfig()
    optim: AdamConfig = AdamConfig(lr=2e-4, b1=0.5, b2=0.999)
    mesh: MeshConfig = MeshConfig()
    sharding: ShardingConfig = ShardingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    observe: ObserveConfig = ObserveConfig()

    def validate(self) -> None:
        if self.gan.conditional and self.data.path:
            raise ConfigError(
                f"gan.conditional=true needs class labels, but data.path={self.data.path!r} is a folder of images "
                "without labels. Fix: set gan.conditional=false, or train on the bundled digits (data.path='')."
            )
        if self.mesh.tensor > 1 or self.mesh.context > 1 or self.mesh.stage > 1:
            raise ConfigError(
                f"mesh.tensor={self.mesh.tensor}, mesh.context={self.mesh.context} and mesh.stage={self.mesh.stage}: "
                "the gan workload is data parallel only (its networks are small and replicated, its images no "
                "sequences). Fix: set mesh.tensor=1 mesh.context=1 mesh.stage=1 and give those devices to mesh.data."
            )
