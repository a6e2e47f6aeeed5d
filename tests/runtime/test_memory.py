"""runtime/memory.py: which memory a size is checked against, and the paragraph when it does not fit."""

import jax
import pytest

from systolic.errors import UserError
from systolic.runtime import memory


class FakeDevice:
    def __init__(self, platform: str, stats: dict | None):
        self.platform, self._stats = platform, stats

    def memory_stats(self):
        return self._stats


def test_cpu_devices_share_the_host_memory():
    have, where = memory.available(jax.devices())
    assert have == memory.host_bytes() > 2**28 and "host memory" in where  # 8 fake devices, counted once


def test_accelerators_sum_their_bytes_limit_and_unknown_means_no_check():
    gpus = [FakeDevice("gpu", {"bytes_limit": 80 * 2**30, "bytes_in_use": 0})] * 4
    assert memory.available(gpus)[0] == 320 * 2**30
    assert memory.available([FakeDevice("tpu", None)]) is None
    memory.check_fits(2**60, [FakeDevice("tpu", None)], what="x", fix="y")  # unknown memory: no refusal


def test_budget_overrides_the_devices_and_the_error_says_what_and_how():
    with memory.budget(16 * 2**30, "1 x TPU v5e"):
        with pytest.raises(UserError, match=r"The model needs at least 32\.0 GiB, but 1 x TPU v5e is 16\.0 GiB.*Fix: shrink"):
            memory.check_fits(32 * 2**30, jax.devices(), what="The model", fix="shrink it.")
    memory.check_fits(32 * 2**30, [FakeDevice("gpu", {"bytes_limit": 40 * 2**30})], what="x", fix="y")
