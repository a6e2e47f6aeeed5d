"""Logical axis names -> mesh axes: the rule tables that decide how the models' arrays are split.

Layers name the axes of their parameters and activations logically (`embed`, `mlp`, `heads`, ...). A rule set
maps each name to the mesh axes `data`, `stage`, `fsdp`, `expert`, `context` and `tensor`; change the table, not
the layers, to change the parallelism layout. A name mapped to None is replicated.

The tables cover the lm and gan workloads' parameters, activations and batches (`RULE_SETS`, chosen by
`sharding.rules`) and the 3-D sim grid's pencils (`GRID_RULES`). The rl workload and the 2-D sim solvers split
their arrays in their own modules: each is the one layout its algorithm's collectives are written for, with no
layer to annotate.

Default layout: `batch` over (data, stage, fsdp, expert), so every device holds different examples; `experts` over
expert (workloads/lm/model/moe.py); `seq` over context (workloads/lm/parallel/context.py); parameters' `embed` over
fsdp (ZeRO-3); `mlp`, `heads`, `kv_heads`, `vocab` over tensor (Megatron-style); `layers` over stage
(workloads/lm/parallel/pipeline.py). Every rule set has expert, context and pipeline parallelism. What each rule
means, and where rl and the 2-D solvers split: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

_ACTIVATIONS: Rules = (
    ("batch", ("data", "stage", "fsdp", "expert")),  # stage: a data axis outside the pipeline (lm/parallel/pipeline.py)
    ("seq", "context"),  # context parallelism: the sequence split, attention by ring (workloads/lm/parallel/context.py)
    ("act_embed", None),  # activations keep d_model whole: their batch axis already uses fsdp
    ("head_dim", None),
    ("layers", "stage"),  # pipeline parallelism: consecutive layers per stage
    ("lora_rank", None),  # LoRA adapters' inner axis: a few columns, kept whole; their other axes shard as the weight's
    ("experts", "expert"),  # MoE expert weights' leading axis: expert parallelism
)

# Each rule set says what the mesh axes mean. Axes a set leaves unused must have size 1 (checked).
RULE_SETS: dict[str, Rules] = {
    # FSDP x tensor parallel: the 3-D default.
    "default": _ACTIVATIONS + (("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"),
                               ("vocab", "tensor"), ("expert_mlp", "tensor")),
    # Pure data parallel: parameters replicated; fsdp acts as a second data axis.
    "dp": _ACTIVATIONS + (("embed", None), ("mlp", None), ("heads", None), ("kv_heads", None), ("vocab", None),
                          ("expert_mlp", None)),
    # ZeRO-3: parameters and optimizer state split over fsdp, no tensor parallelism.
    "fsdp": _ACTIVATIONS + (("embed", "fsdp"), ("mlp", None), ("heads", None), ("kv_heads", None), ("vocab", None),
                            ("expert_mlp", None)),
    # Megatron tensor parallelism (column/row split of attention and MLP), data parallel over data x fsdp.
    "tp": _ACTIVATIONS + (("embed", None), ("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"),
                          ("vocab", "tensor"), ("expert_mlp", "tensor")),
}
DEFAULT_RULES: Rules = RULE_SETS["default"]

# The 3-D spectral grid of the sim workload (workloads/sim/pencil.py): x (and ky) split over `grid_rows`, y (and kz)
# over `grid_cols`, so the mesh is a 2-D grid of pencils: mesh.data=2 mesh.fsdp=4 is 2 x 4, mesh.data=8 is a slab.
GRID_RULES: Rules = (("grid_rows", "data"), ("grid_cols", ("fsdp", "tensor")))


def rules_for(name: str, mesh: Mesh | None = None) -> Rules:
    """The named rule set, checked against the mesh: an axis of size > 1 that the rules never use would
    silently replicate work, so it is an error."""
    rules = RULE_SETS[name]
    if mesh is not None:
        used = {axis for _, target in rules for axis in ((target,) if isinstance(target, str) else target or ())}
        idle = [axis for axis, size in mesh.shape.items() if size > 1 and axis not in used]
        if idle:
            from systolic.errors import ConfigError

            raise ConfigError(
                f"sharding.rules={name} does not use the mesh axis {idle[0]} (size {mesh.shape[idle[0]]}), so those "
                f"devices would only repeat each other's work. Fix: set mesh.{idle[0]}=1 (giving its devices to "
                "mesh.data), or pick rules that use it (default uses fsdp and tensor, tp uses tensor, fsdp uses fsdp; "
                "all use expert, context and stage)."
            )
    return rules


def logical_to_spec(names: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> P:
    """PartitionSpec for an array whose axes have these logical names."""
    table = dict(rules)
    spec = []
    for name in names:
        if name is None:
            spec.append(None)
        elif name not in table:
            raise KeyError(f"logical axis '{name}' has no entry in the sharding rules table; add it to DEFAULT_RULES")
        else:
            spec.append(table[name])
    return P(*spec)


def check_divisible(shapes: dict[str, tuple[int, ...]], specs: dict[str, P], mesh: Mesh) -> None:
    """Every sharded dimension must split evenly over its mesh axes; checked before any compilation so the
    error can name the array, the dimension and the axis."""
    from systolic.errors import ConfigError

    for path, shape in shapes.items():
        for dim, (size, axes) in enumerate(zip(shape, specs[path])):
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            parts = 1
            for axis in axes:
                parts *= mesh.shape[axis]
            if size % parts:
                raise ConfigError(
                    f"{path} has size {size} in dimension {dim}, which is split over mesh axis "
                    f"{' x '.join(axes)} = {parts} devices, but {size} is not divisible by {parts}. Fix: change the "
                    f"mesh ({', '.join(f'mesh.{a}' for a in axes)}) to a divisor of {size}, or the model size "
                    "(e.g. model.heads / model.kv_heads / model.d_model / model.moe.experts) to a multiple of it."
                )


def named_sharding(mesh: Mesh, names: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins an activation's layout by logical names; a no-op outside `activate(mesh)` so unit tests need no mesh.
    Inside a `shard_map` the axes it makes manual are left out: the array is already this device's block of them."""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, without_manual_axes(logical_to_spec(names, rules)))


def without_manual_axes(spec: P) -> P:
    """`spec` less the mesh axes an enclosing `shard_map` made manual (there the array is already this device's
    block of them): what a sharding constraint or a nested `shard_map` inside it may name."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if not manual:
        return spec
    keep = lambda axes: tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ())  # noqa: E731
                              if a not in manual) or None
    return P(*(keep(axes) for axes in spec))


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Makes `mesh` and `rules` current: parameters are born sharded and `constrain` takes effect."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs (from `jax.eval_shape`) that carry their target shardings: a restore or AOT target."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
