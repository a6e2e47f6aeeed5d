"""A real 3-D FFT of an n^3 periodic grid split into pencils over a 2-D device mesh, for use inside `shard_map`.

Physical layout: x split over the mesh's row axes (P1 parts), y over its column axes (P2 parts), z whole on
every device: each holds an (n/P1, n/P2, n) pencil along z. Spectral layout: kx whole, ky split over the rows,
the n/2 kept kz over the columns: each holds (n, n/P1, n/(2 P2)). Which mesh axes are rows and columns is a
rule in the sharding table (`runtime/sharding.py`, GRID_RULES), read by logical names here.

Forward: a local real FFT along z; an `all_to_all` within each mesh row that trades z-frequencies for y (now
whole); a local FFT along y; an `all_to_all` within each mesh column that trades ky for x; a local FFT along x.
The inverse runs the same backwards. Each device sends 1/P2 then 1/P1 of its pencil to the devices of its row and
column, and no device ever holds the whole grid. A slab is the special case of one part along either mesh axis
(8x1: only the x/ky transpose; 1x8: only the y/kz one); one device is plain `rfftn`/`irfftn`, no collective.

The real FFT along z gives n/2 + 1 values; the last (Nyquist, kz = n/2) is dropped so n/2 splits evenly over
P2 devices. Nothing is lost for dealiased fields: the 2/3 rule zeroes every |k| >= n/3 anyway.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from systolic.errors import ConfigError
from systolic.runtime.sharding import GRID_RULES, Rules, logical_to_spec
from systolic.workloads.sim.slab import irfft_in_pairs, pairs_real_transforms, rfft_by_half_length

# Logical names of the physical grid's axes (x, y, z); GRID_RULES maps the split ones to mesh axes. The spectral
# layout puts the same mesh axes on (ky, kz).
PHYSICAL_AXES = ("grid_rows", "grid_cols", None)


def _mesh_axes(spec_entry) -> tuple[str, ...]:
    return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry or ())


@dataclasses.dataclass(frozen=True)
class Pencil:
    n: int  # grid points a side
    row_axes: tuple[str, ...] = ()  # mesh axes that split x (physical) and ky (spectral); () = not split
    col_axes: tuple[str, ...] = ()  # mesh axes that split y (physical) and kz (spectral)
    rows: int = 1  # P1: product of the row axes' sizes
    cols: int = 1  # P2
    pair_real_transforms: bool = False  # the z passes as complex transforms of half the work (slab.py); TPUs

    def __post_init__(self):
        assert self.n % self.rows == 0 and self.n % (2 * self.cols) == 0, "checked by make_pencil"

    @property
    def physical_spec(self) -> P:
        return P(self.row_axes or None, self.col_axes or None, None)

    @property
    def spectral_spec(self) -> P:
        return P(None, self.row_axes or None, self.col_axes or None)

    @property
    def parts(self) -> int:
        return self.rows * self.cols

    def forward(self, f: jax.Array) -> jax.Array:
        """(..., n/P1, n/P2, n) real -> (..., n, n/P1, n/(2 P2)) complex, unnormalised (like numpy.fft)."""
        n = self.n
        if self.parts == 1 and not self.pair_real_transforms:
            return jnp.fft.rfftn(f, axes=(-3, -2, -1))[..., : n // 2]  # (..., n, n, n/2)
        # (..., n/P1, n/P2, n/2): drop Nyquist so kz splits evenly
        g = rfft_by_half_length(f) if self.pair_real_transforms else jnp.fft.rfft(f, axis=-1)[..., : n // 2]
        if self.cols > 1:  # within a mesh row: kz split in P2 chunks, y gathered whole
            g = lax.all_to_all(g, self.col_axes, split_axis=g.ndim - 1, concat_axis=g.ndim - 2, tiled=True)
        g = jnp.fft.fft(g, axis=-2)  # (..., n/P1, n, n/(2 P2)): y -> ky
        if self.rows > 1:  # within a mesh column: ky split in P1 chunks, x gathered whole
            g = lax.all_to_all(g, self.row_axes, split_axis=g.ndim - 2, concat_axis=g.ndim - 3, tiled=True)
        return jnp.fft.fft(g, axis=-3)  # (..., n, n/P1, n/(2 P2)): x -> kx

    def inverse(self, g: jax.Array) -> jax.Array:
        """(..., n, n/P1, n/(2 P2)) complex -> (..., n/P1, n/P2, n) real; the dropped Nyquist plane is taken as 0."""
        n = self.n
        paired = self.pair_real_transforms and g.ndim >= 4 and g.shape[-4] % 2 == 0
        if self.parts == 1 and not paired:
            return jnp.fft.irfftn(g, s=(n, n, n), axes=(-3, -2, -1))  # pads kz to n/2 + 1 with zeros
        f = jnp.fft.ifft(g, axis=-3)  # (..., n, n/P1, n/(2 P2)): kx -> x
        if self.rows > 1:
            f = lax.all_to_all(f, self.row_axes, split_axis=f.ndim - 3, concat_axis=f.ndim - 2, tiled=True)
        f = jnp.fft.ifft(f, axis=-2)  # (..., n/P1, n, n/(2 P2)): ky -> y
        if self.cols > 1:
            f = lax.all_to_all(f, self.col_axes, split_axis=f.ndim - 2, concat_axis=f.ndim - 1, tiled=True)
        if paired:  # (..., fields, a, b, n/2) as (..., fields, a * b, n/2) rows
            return irfft_in_pairs(f.reshape(*f.shape[:-3], -1, f.shape[-1])).reshape(*f.shape[:-1], n)
        return jnp.fft.irfft(f, n=n, axis=-1)  # (..., n/P1, n/P2, n)

    def wavenumber_indices(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Integer wavenumbers of this device's spectral block: kx (n, 1, 1) in FFT order, ky (1, n/P1, 1) in FFT
        order from this device's offset, kz (1, 1, n/(2 P2)) from 0."""
        n, ky_local, kz_local = self.n, self.n // self.rows, self.n // (2 * self.cols)
        freqs = jnp.fft.fftfreq(n, 1.0 / n).astype(jnp.int32)
        row = lax.axis_index(self.row_axes) if self.rows > 1 else 0
        col = lax.axis_index(self.col_axes) if self.cols > 1 else 0
        ky = lax.dynamic_slice_in_dim(freqs, row * ky_local, ky_local)
        kz = col * kz_local + jnp.arange(kz_local, dtype=jnp.int32)
        return freqs[:, None, None], ky[None, :, None], kz[None, None, :]

    def physical_indices(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Integer grid indices of this device's physical block: x (n/P1, 1, 1), y (1, n/P2, 1), z (1, 1, n)."""
        rows, cols = self.n // self.rows, self.n // self.cols
        row = lax.axis_index(self.row_axes) if self.rows > 1 else 0
        col = lax.axis_index(self.col_axes) if self.cols > 1 else 0
        x = row * rows + jnp.arange(rows, dtype=jnp.int32)
        y = col * cols + jnp.arange(cols, dtype=jnp.int32)
        return x[:, None, None], y[None, :, None], jnp.arange(self.n, dtype=jnp.int32)[None, None, :]

    # Reductions run even over size-1 axes inside shard_map: they cost nothing there, and they mark the result as
    # the same on every device, which shard_map needs to return it replicated.
    @property
    def axes(self) -> tuple[str, ...]:
        return self.row_axes + self.col_axes

    def psum(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, self.axes) if self.axes else x

    def pmax(self, x: jax.Array) -> jax.Array:
        return lax.pmax(x, self.axes) if self.axes else x


def make_pencil(n: int, mesh: Mesh, rules: Rules = GRID_RULES) -> Pencil:
    """The pencil decomposition of an n^3 grid on `mesh`, its split axes from the rules table; checks that the
    grid splits evenly."""
    physical = logical_to_spec(PHYSICAL_AXES, rules)
    row_axes, col_axes = _mesh_axes(physical[0]), _mesh_axes(physical[1])
    rows, cols = math.prod(mesh.shape[a] for a in row_axes), math.prod(mesh.shape[a] for a in col_axes)
    if n % rows or n % (2 * cols):
        raise ConfigError(
            f"grid.n={n} cannot be split into {rows} x {cols} pencils: the 3-D spectral solver splits x (and ky) over "
            f"mesh {' x '.join(row_axes)} = {rows} devices and y (and the n/2 kept kz) over mesh "
            f"{' x '.join(col_axes)} = {cols}, so n must be a multiple of {rows} and of 2 x {cols}. Fix: "
            f"grid.n={_multiple(n, rows, 2 * cols)}, or a mesh whose sizes divide {n}."
        )
    # A mesh axis of size 1 need not take part: keep the names only where they split something.
    row_axes = tuple(a for a in row_axes if mesh.shape[a] > 1)
    col_axes = tuple(a for a in col_axes if mesh.shape[a] > 1)
    return Pencil(n, row_axes, col_axes, rows, cols, pair_real_transforms=pairs_real_transforms(mesh))


def _multiple(n: int, a: int, b: int) -> int:
    step = math.lcm(a, b)
    return step * max(1, round(n / step))
