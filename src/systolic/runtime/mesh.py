"""The device mesh: (data, stage, fsdp, expert, context, tensor) axes sized from the config, checked against the
devices that exist.
exist.

`expert` splits mixture-of-experts weights (lm/model/moe.py); everything else sees it as one more data-parallel axis:
the batch is split over data x fsdp x expert, as MaxText does, so attention and the dense layers do not repeat
work on the expert ranks. `context` splits each sequence (lm/parallel/context.py): not a batch axis, as its devices hold
parts of the same rows. `stage` holds pipeline stages (lm/parallel/pipeline.py): inside the pipeline each stage holds its
own layers and every stage sees the same examples, one microbatch after another; outside it (embedding, head, loss)
the batch is split over `stage` too, so that work is not repeated on every stage."""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from systolic.config import MeshConfig
from systolic.errors import ConfigError

# tensor innermost: its collectives are the most frequent; context next to it: a ring hop every layer; stage next
# to the outermost (MaxText's order): its point-to-point sends are few and can cross the slowest links after data's
# gradient reduction.
AXES = ("data", "stage", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "stage", "fsdp", "expert")  # the axes that hold different examples (stage: outside the pipeline)


def resolve_shape(cfg: MeshConfig, n_devices: int, *, cpu: bool = False) -> tuple[int, ...]:
    """Axis sizes (in AXES order) with -1 filled in; raises a ConfigError naming a valid choice when they do not fit
    (and, for `cpu` devices, how to try the layout on fake ones)."""
    sizes = [cfg.data, cfg.stage, cfg.fsdp, cfg.expert, cfg.context, cfg.tensor]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % fixed:
            raise _mismatch(cfg, n_devices, fixed if cpu else None)
        sizes[sizes.index(-1)] = n_devices // fixed
    if math.prod(sizes) != n_devices:
        raise _mismatch(cfg, n_devices, math.prod(sizes) if cpu else None)
    return tuple(sizes)  # type: ignore[return-value]


def _mismatch(cfg: MeshConfig, n_devices: int, fake_devices: int | None) -> ConfigError:
    # A layout meant for a pod can be tried on a laptop: XLA:CPU splits the host into as many devices as asked.
    fake = ("" if fake_devices is None else
            f" To try this layout on this machine's CPU, give it {fake_devices} fake devices: start the command with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={fake_devices} (slower than one device: they share "
            "the same cores).")
    return ConfigError(
        f"The mesh mesh.data={cfg.data} mesh.stage={cfg.stage} mesh.fsdp={cfg.fsdp} mesh.expert={cfg.expert} "
        f"mesh.context={cfg.context} mesh.tensor={cfg.tensor} does not fit the "
        f"{n_devices} available device(s): the product of the axis sizes must equal the device count (-1 takes "
        f"the rest). Fix: e.g. mesh.data=-1 mesh.fsdp=1 mesh.tensor=1 (pure data parallel over {n_devices}), or "
        f"sizes whose product is {n_devices}.{fake}"
    )


def make_mesh(cfg: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """A mesh with Auto axis types: with Explicit ones (the jax default) embedding gathers raise ShardingTypeError.

    With `mesh.slices` > 1 it is the hybrid mesh of several TPU slices: each slice holds data/slices x fsdp x expert x
    context x tensor over its own ICI links and the data axis runs across slices, so the one collective that crosses
    the slower data-center network is the data-parallel gradient reduction (jax's `create_hybrid_device_mesh`).
    Devices without a slice index (CPU, GPU) take each process as a slice."""
    devices = devices if devices is not None else jax.devices()
    shape = resolve_shape(cfg, len(devices), cpu=jax.process_count() == 1 and devices[0].platform == "cpu")
    if cfg.slices == 1:
        return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
    from jax.experimental import mesh_utils

    by_process = getattr(devices[0], "slice_index", None) is None
    granules = len({d.process_index if by_process else d.slice_index for d in devices})
    if shape[0] % cfg.slices or granules != cfg.slices:
        raise ConfigError(
            f"mesh.slices={cfg.slices} splits the data axis across {cfg.slices} "
            f"{'processes' if by_process else 'TPU slices'}, but the mesh has mesh.data={shape[0]} and the devices "
            f"span {granules} {'processes' if by_process else 'slices'}. Fix: mesh.slices={granules} with mesh.data a "
            f"multiple of it (e.g. mesh.data={granules} or -1), or mesh.slices=1."
        )
    per_slice = (shape[0] // cfg.slices, *shape[1:])
    grid = mesh_utils.create_hybrid_device_mesh(per_slice, (cfg.slices,) + (1,) * (len(AXES) - 1), devices,
                                                process_is_granule=by_process)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading axis split over every data-parallel axis, the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def local_rows(sharding: NamedSharding, global_rows: int) -> tuple[int, int]:
    """[lo, hi): the block of leading-axis rows held by this process's devices.

    With the batch split over the data axes and processes laid out along them, each process holds its own
    block; when an axis that spans processes is not a batch axis (tensor parallel across hosts), several
    processes hold the same rows. Either way each process reads only the rows its devices need.
    """
    ndim = len(sharding.spec) or 1
    # The other dimensions sized to their number of shards (the sequence split over context, say), so they divide.
    parts = [math.prod(sharding.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
             for axes in tuple(sharding.spec)[1:]]
    index = sharding.addressable_devices_indices_map((global_rows, *parts, *(1,) * (ndim - 1 - len(parts))))
    rows = sorted({(s[0].start or 0, s[0].stop if s[0].stop is not None else global_rows) for s in index.values()})
    lo, hi = rows[0][0], rows[-1][1]
    assert sum(b - a for a, b in rows) == hi - lo, f"process rows are not contiguous: {rows}"
    return lo, hi


def bytes_per_device(tree) -> int:
    """Bytes each device holds of a pytree of sharded `jax.ShapeDtypeStruct`s (the largest shard, when uneven)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch(global_batch: int, grad_accum: int, mesh: Mesh) -> None:
    """Each accumulation micro-batch is split over the data axes, so it must divide evenly."""
    dp = data_parallel_size(mesh)
    micro = global_batch // grad_accum
    if micro % dp:
        good = dp * grad_accum * max(1, round(micro / dp))
        axes = " x ".join(f"{a}={mesh.shape[a]}" for a in BATCH_AXES if a != "stage" or mesh.shape[a] > 1)
        raise ConfigError(
            f"train.batch_size={global_batch} (grad_accum={grad_accum}, so {micro} examples per micro-step) cannot be "
            f"split evenly over the {dp} data-parallel devices of mesh {axes} ({jax.device_count()} devices in "
            f"all). Fix: use a batch size that is a multiple of {dp * grad_accum}, e.g. train.batch_size={good}, or "
            "change mesh.data/mesh.stage/mesh.fsdp/mesh.expert."
        )


OPTIONAL_AXES = ("stage", "expert", "context")  # named in descriptions only when split: most runs leave them at 1


def describe(mesh: Mesh) -> str:
    """"data=4 x fsdp=2 x tensor=1": the expert, context and stage axes are named only when split."""
    return " x ".join(f"{name}={size}" for name, size in mesh.shape.items() if name not in OPTIONAL_AXES or size > 1)
