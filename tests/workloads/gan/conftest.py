"""A tiny gan config shared by the gan tests."""

import pytest

TINY_GAN = ["model.latent_dim=8", "model.g_channels=32", "model.d_channels=32", "train.batch_size=16",
            "train.steps=4", "gan.eval_samples=64", "checkpoint.every_steps=2", "checkpoint.async_save=false",
            "observe.log_every=1", "observe.tensorboard=false", "observe.plot=false"]


@pytest.fixture
def tiny_overrides() -> list[str]:
    return list(TINY_GAN)


@pytest.fixture
def make_cfg():
    from systolic import config as config_lib
    from systolic.workloads.gan.config import GANConfig

    def make(*extra: str) -> GANConfig:
        return config_lib.from_dict(GANConfig, config_lib.apply_overrides({}, [*TINY_GAN, *extra]))

    return make
