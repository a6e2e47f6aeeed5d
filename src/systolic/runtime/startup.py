"""Process start-up for a command, before anything creates JAX's backend: the platform, the XLA:CPU flags and the
host allocator (runtime/cpu_tuning.py), the compile cache, the compiled extensions, then signals armed; and
joining a multi-process run from the `distributed.*` overrides."""

from __future__ import annotations


from systolic.runtime import interrupts


def prepare(*, workload: str | None, stepping: bool, compiles: bool) -> None:
    """Prepares the process for a command that runs `workload` (None: none), once its platform is chosen:
    `stepping` (many steps of one compiled function) gets the host allocator setting, `compiles` the compile
    cache and the extension imports. Then arms the interrupt handlers: a signal recorded so far raises here."""
    from systolic.runtime import cpu_tuning, xla_env

    xla_env.check_at_start()  # XLA_FLAGS that would abort the process, a JAX_PLATFORMS that is not installed
    # Before anything creates jax's backend (XLA reads XLA_FLAGS once) or starts its thread pools (the allocator).
    cpu_tuning.apply_at_start(workload=workload, stepping=stepping)
    if compiles:  # the others (launch, tokenizer, data) need none of this, and start faster
        from systolic.runtime import compile_cache

        compile_cache.enable()
        _import_extensions()
    interrupts.arm()  # from now on a signal raises at once


def _import_extensions() -> None:
    """Imports the compiled extensions a command may load while signals are only recorded (runtime/interrupts.py:
    an interrupt inside an extension's import can crash the process later)."""
    import jax  # noqa: F401  (jaxlib's extensions)
    import numpy  # noqa: F401

    for name in ("orbax.checkpoint", "tensorstore", "grain", "flax.nnx", "optax"):
        try:
            __import__(name)
        except ImportError:
            pass  # an optional one that is missing is reported where it is needed


def join_processes(overrides: list[str]) -> list[str]:
    """Joins the multi-process run, if any, from the `distributed.*` overrides (which differ per process and so
    are not part of the run's config); returns the other overrides."""
    from systolic import config as config_lib
    from systolic.config import DistributedConfig
    from systolic.runtime import distributed

    mine = [o for o in overrides if o.startswith("distributed.")]
    tree = config_lib.apply_overrides({}, mine).get("distributed", {})
    distributed.initialize(config_lib.from_dict(DistributedConfig, tree, "distributed."))
    return [o for o in overrides if not o.startswith("distributed.")]
