"""Test setup: 8 fake CPU devices so every sharding layout is tested on one machine.

XLA reads XLA_FLAGS once, when jax initialises its backend, so this must run before anything imports jax.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# JAX on the CPU, also on a machine with an accelerator, unless SYSTOLIC_TEST_PLATFORMS names others: on the lent TPU
# `benchmarks/harness/tpu.sh test` sets it to `tpu,cpu`, so that the chip is JAX's default backend (the `tpu` tests run
# there; `pytest -m tpu` alone there would skip them all) and the 8 fake CPU devices stay for the CPU side of a test.
os.environ.setdefault("JAX_PLATFORMS", os.environ.get("SYSTOLIC_TEST_PLATFORMS", "cpu"))
ON_CHIP = os.environ["JAX_PLATFORMS"] != "cpu"
# SYSTOLIC_TEST_TPU_ON_CPU=1 runs the `tpu` tests on the CPU (the chip's side there too): a check of the tests
# themselves while writing them, since the chip is lent rarely.
TPU_ON_CPU = os.environ.get("SYSTOLIC_TEST_TPU_ON_CPU", "") not in ("", "0")
if not ON_CHIP:
    # Compile-only TPU devices (tpu_aot tests) touch no chip; without this, two test processes that load libtpu at
    # once (pytest-xdist workers) fail on libtpu's /tmp/libtpu_lockfile. `engine.plan.devices_for` sets it for users.
    # Not on the chip: one process holds it, and a second should fail at once rather than share it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Strict dtype promotion, as Equinox's tests run: mixing dtypes (a bf16 activation times an f32 weight, an int
# index plus a float) is an error unless the code casts explicitly. The environment variable carries it into the
# CLI subprocesses that the end-to-end tests start.
os.environ["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"

# The data cache (raw corpora tokenized once, verified shards) in a folder of this test process, never the user's
# ~/.cache: each pytest-xdist worker imports this file and gets its own, inherited by the CLI subprocesses it starts.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ["SYSTOLIC_CACHE"] = tempfile.mkdtemp(prefix="systolic-test-cache-")
atexit.register(shutil.rmtree, os.environ["SYSTOLIC_CACHE"], ignore_errors=True)

from systolic.runtime import cpu_tuning  # noqa: E402

# The XLA:CPU flags the CLI sets for lm, so the lm tests (most of them) compile what users run; one process cannot
# have each workload's. The CLI subprocesses inherit them as a user's XLA_FLAGS, which win over the CLI's choice.
# Not the allocator setting: it slows compilation, which is most of a test's time.
cpu_tuning.apply_at_start(workload="lm", stepping=False)

import jax  # noqa: E402
import pytest  # noqa: E402

from slow_list import slow_node_ids  # noqa: E402  (tests/ is on sys.path)

jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    platform = jax.default_backend()
    slow = slow_node_ids()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and platform != "gpu":
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))
        if "tpu" in item.keywords and platform != "tpu" and not TPU_ON_CPU:
            item.add_marker(pytest.mark.skip(reason="needs a TPU (on one: SYSTOLIC_TEST_PLATFORMS=tpu,cpu, as "
                                                    "benchmarks/harness/tpu.sh test sets)"))


# SHARED LM HELPERS --------------------------------------------------------------------------------------------
# A tiny language model on a small real corpus, used by the lm, layout and engine tests.

import types  # noqa: E402
from pathlib import Path  # noqa: E402

from tiny import TINY_LM, run_steps  # noqa: E402  (tests/ is on sys.path: pyproject's pythonpath)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A slice of the standard library's own source, copied so tests are self-contained."""
    import sysconfig

    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("functools.py", "textwrap.py", "string.py", "bisect.py", "heapq.py", "colorsys.py"):
        (root / name).write_text((stdlib / name).read_text(encoding="utf-8"), encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def tiny_lm(corpus_dir):
    from systolic import config as config_lib
    from systolic.config import MeshConfig
    from systolic.data.tokenizer import make_tokenizer
    from systolic.runtime import mesh as mesh_lib
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.train import build_task

    def make_cfg(*extra: str) -> LMConfig:
        return config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [*TINY_LM, f"data.path={corpus_dir}", *extra]))

    def run_lm_steps(cfg: LMConfig, mesh, n: int):
        """(prepared task, state after n steps, the n losses)."""
        prepared = build_task(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
        state, metrics = run_steps(prepared.task, n, mesh=mesh, rules=prepared.rules)
        return prepared, state, [float(m["loss"]) for m in metrics]

    def single_device_mesh():
        return mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])

    return types.SimpleNamespace(make_cfg=make_cfg, run_steps=run_lm_steps, single_device_mesh=single_device_mesh)


# One persistent XLA cache for the whole session (inherited by CLI subprocesses): the many small runs of the
# same tiny programs compile once. Never the user's ~/.cache.
if not os.environ.get("SYSTOLIC_COMPILE_CACHE"):
    os.environ["SYSTOLIC_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="systolic-test-xla-")
from systolic.runtime import compile_cache  # noqa: E402

compile_cache.enable()
