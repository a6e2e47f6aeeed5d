"""A real 2-D FFT of an n x n periodic grid split into row slabs over devices, for use inside `shard_map`.

Physical layout: rows (x) split over the devices, each holding (n/P, n). Spectral layout: all n kx values on
every device, the n/2 kept ky values split, each holding (n, n/(2P)). Forward: a local real FFT along the
unsplit y axis, one `all_to_all` transpose, a local FFT along x. Inverse: the same backwards. This is the
communication pattern of slab-decomposed spectral codes on clusters: each device sends 1/P of its slab to
every other device once per transform, and no device ever holds the whole grid.

The real FFT along y gives n/2 + 1 values; the last (Nyquist, ky = n/2) is dropped so n/2 splits evenly over
P devices. Nothing is lost for dealiased fields: the 2/3 rule zeroes every |k| >= n/3 anyway.

With P = 1 both directions are one `rfft2`/`irfft2` call and no collective, which XLA:CPU runs about 1.5x
faster than the two 1-D passes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Slab:
    n: int  # grid points a side
    axes: tuple[str, ...] = ()  # mesh axes the slabs are split over; () = a plain function, no shard_map
    parts: int = 1  # product of those axes' sizes

    def __post_init__(self):
        assert self.n % (2 * self.parts) == 0, "checked by check_divisible before building a Slab"

    @property
    def physical_spec(self) -> P:
        return P(self.axes, None)

    @property
    def spectral_spec(self) -> P:
        return P(None, self.axes)

    @property
    def ky_local(self) -> int:
        return self.n // (2 * self.parts)

    def forward(self, f: jax.Array) -> jax.Array:
        """(..., n/P, n) real -> (..., n, n/(2P)) complex, unnormalised (like numpy.fft)."""
        n = self.n
        if self.parts == 1:
            return jnp.fft.rfft2(f)[..., : n // 2]  # (..., n, n/2)
        g = jnp.fft.rfft(f, axis=-1)[..., : n // 2]  # (..., n/P, n/2): drop Nyquist so ky splits evenly
        # Transpose: split ky into P chunks, send chunk j to device j, stack the received row slabs in order.
        g = lax.all_to_all(g, self.axes, split_axis=g.ndim - 1, concat_axis=g.ndim - 2, tiled=True)  # (..., n, n/(2P))
        return jnp.fft.fft(g, axis=-2)

    def inverse(self, g: jax.Array) -> jax.Array:
        """(..., n, n/(2P)) complex -> (..., n/P, n) real; the dropped Nyquist column is taken as zero."""
        n = self.n
        if self.parts == 1:
            return jnp.fft.irfft2(g, s=(n, n))  # pads the ky axis to n/2 + 1 with zeros
        f = jnp.fft.ifft(g, axis=-2)  # (..., n, n/(2P))
        f = lax.all_to_all(f, self.axes, split_axis=f.ndim - 2, concat_axis=f.ndim - 1, tiled=True)  # (..., n/P, n/2)
        return jnp.fft.irfft(f, n=n, axis=-1)

    def wavenumber_indices(self) -> tuple[jax.Array, jax.Array]:
        """Integer wavenumbers of this device's spectral block: kx (n, 1) in FFT order, ky (1, n/(2P))."""
        kx = jnp.fft.fftfreq(self.n, 1.0 / self.n).astype(jnp.int32)[:, None]
        offset = lax.axis_index(self.axes) * self.ky_local if self.parts > 1 else 0
        ky = (offset + jnp.arange(self.ky_local, dtype=jnp.int32))[None, :]
        return kx, ky

    # Reductions run even over size-1 axes inside shard_map: they cost nothing there, and they mark the result
    # as the same on every device, which shard_map needs to return it replicated.
    def psum(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, self.axes) if self.axes else x

    def pmax(self, x: jax.Array) -> jax.Array:
        return lax.pmax(x, self.axes) if self.axes else x
