"""Logical axis names -> mesh axes: the one table that decides how every array is split.

Layers name the axes of their parameters and activations logically (`embed`, `mlp`, `heads`, ...). This table
maps each name to the mesh axes `data`, `fsdp` and `tensor`; change the table, not the layers, to change the
parallelism layout. A name mapped to None is replicated.

Default layout (2-D/3-D combinations follow from the mesh shape alone):
- `batch` over (data, fsdp): every device holds different examples (data parallel; FSDP is data parallel too).
- parameters' `embed` axis over fsdp: ZeRO-3 style, each fsdp rank stores a slice and XLA all-gathers it
  before use and reduce-scatters the gradient.
- `mlp`, `heads`, `kv_heads`, `vocab` over tensor: Megatron-style column/row split of MLP and attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax
from flax import nnx
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("embed", "fsdp"),
    ("act_embed", None),  # activations keep d_model whole: their batch axis already uses fsdp
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("layers", None),
)


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


def named_sharding(mesh: Mesh, names: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins an activation's layout by logical names; a no-op outside `activate(mesh)` so unit tests need no mesh."""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Makes `mesh` and `rules` current: parameters are born sharded and `constrain` takes effect."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield
