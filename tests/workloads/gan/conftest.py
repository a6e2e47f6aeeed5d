"""The tiny gan config (tests/tiny.py) as fixtures."""

import pytest
from tiny import TINY_GAN


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
