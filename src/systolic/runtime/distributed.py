"""Multi-process start-up through `jax.distributed` (JAX's multi-controller runtime).

Every process runs the same program on its own devices; XLA's collectives (ICI on TPU, NCCL on GPU, gloo on
CPU) move data between them. This module only decides *whether* and *how* to call
`jax.distributed.initialize`, which must happen before anything touches a device.
"""

from __future__ import annotations

import os

import jax

from systolic.config import DistributedConfig
from systolic.errors import UserError

# Set by `systolic launch` for each process it starts.
ENV_COORDINATOR = "SYSTOLIC_COORDINATOR"
ENV_NUM_PROCESSES = "SYSTOLIC_NUM_PROCESSES"
ENV_PROCESS_ID = "SYSTOLIC_PROCESS_ID"


def detected_cluster() -> str | None:
    """The multi-process cluster `jax.distributed` can configure itself from, if any (by its environment)."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env:
        return "SLURM"
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in env:
        return "Cloud TPU"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    if "JOBSET_NAME" in env or int(env.get("JAX_NUM_PROCESSES", "1") or 1) > 1:
        return "Kubernetes"
    return None


def settings_from_env(cfg: DistributedConfig) -> DistributedConfig:
    """Fills coordinator/num_processes/process_id from `systolic launch`'s variables when not given."""
    if cfg.coordinator or ENV_COORDINATOR not in os.environ:
        return cfg
    try:
        return DistributedConfig(
            coordinator=os.environ[ENV_COORDINATOR],
            num_processes=int(os.environ[ENV_NUM_PROCESSES]),
            process_id=int(os.environ[ENV_PROCESS_ID]),
            auto=cfg.auto,
            initialization_timeout_s=cfg.initialization_timeout_s,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
        )
    except (KeyError, ValueError) as e:
        raise UserError(
            f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} are missing or not integers ({e}). "
            "Fix: start processes with `systolic launch`, or unset these variables."
        ) from None


def initialize(cfg: DistributedConfig) -> str:
    """Joins the process group if this is a multi-process run; returns a one-line description."""
    cfg = settings_from_env(cfg)
    common = dict(initialization_timeout=cfg.initialization_timeout_s, heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    if cfg.coordinator:
        if cfg.num_processes == 1:
            return "single process"
        jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, **common)
        return f"process {cfg.process_id} of {cfg.num_processes}, coordinator {cfg.coordinator}"
    cluster = detected_cluster() if cfg.auto else None
    if cluster is None:
        return "single process"
    jax.distributed.initialize(**common)  # jax reads the cluster's own variables
    return f"process {jax.process_index()} of {jax.process_count()} ({cluster} detected)"
