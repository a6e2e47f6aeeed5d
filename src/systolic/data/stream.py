"""Host batches -> global device arrays, with the iterator's position kept for checkpoints."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding


class DeviceStream:
    """Wraps a host iterator that yields this process's rows; yields global arrays sharded over the mesh.

    Each process passes only its local rows; `make_array_from_process_local_data` stitches them into one global
    array without any process reading the others' data.
    """

    def __init__(self, iterator: Any, sharding: NamedSharding, global_rows: int):
        self._iterator = iterator
        self._sharding = sharding
        self._global_rows = global_rows

    def __iter__(self) -> "DeviceStream":
        return self

    def __next__(self) -> Any:
        return place(next(self._iterator), self._sharding, self._global_rows)

    def get_state(self) -> dict[str, Any]:
        return self._iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._iterator.set_state(state)


def place(host_batch: Any, sharding: NamedSharding, global_rows: int) -> Any:
    """This process's rows of each array -> one global array of `global_rows` rows."""

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (global_rows, *x.shape[1:]))

    return jax.tree.map(one, host_batch)
