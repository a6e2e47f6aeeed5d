"""A real 2-D FFT of an n x n periodic grid split into row slabs over devices, for use inside `shard_map`.

Physical layout: rows (x) split over the devices, each holding (n/P, n). Spectral layout: all n kx values on
every device, the n/2 kept ky values split, each holding (n, n/(2P)). Forward: a local real FFT along the
unsplit y axis, one `all_to_all` transpose, a local FFT along x. Inverse: the same backwards. This is the
communication pattern of slab-decomposed spectral codes on clusters: each device sends 1/P of its slab to
every other device once per transform, and no device ever holds the whole grid. The Nyquist ky = n/2 is dropped so
n/2 splits evenly over P devices; dealiased fields lose nothing (the 2/3 rule zeroes every |k| >= n/3 anyway).
With P = 1 both directions are one `rfft2`/`irfft2` call and no collective.

`pair_real_transforms` (on for TPUs, `make_slab`): the TPU's real FFTs cost as much as complex ones of the full
length, so the inverse's y pass takes two real fields as one complex transform and the forward's y pass a real row
of n as a complex row of n/2, the textbook real-FFT identities; a 2-D solver stage then costs about two thirds of
the FLOPs, with results equal to round-off. On XLA:CPU, whose real transforms are real, it is slower, so it stays
off there. The cost counts and timings: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Slab:
    n: int  # grid points a side
    axes: tuple[str, ...] = ()  # mesh axes the slabs are split over; () = a plain function, no shard_map
    parts: int = 1  # product of those axes' sizes
    pair_real_transforms: bool = False  # the y passes as complex transforms of half the work (see above); TPUs

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
        if self.parts == 1 and not self.pair_real_transforms:
            return jnp.fft.rfft2(f)[..., : n // 2]  # (..., n, n/2)
        # (..., n/P, n/2): drop Nyquist so ky splits evenly
        g = rfft_by_half_length(f) if self.pair_real_transforms else jnp.fft.rfft(f, axis=-1)[..., : n // 2]
        if self.parts > 1:
            # Transpose: split ky into P chunks, send chunk j to device j, stack the received row slabs in order.
            # (..., n, n/(2P))
            g = lax.all_to_all(g, self.axes, split_axis=g.ndim - 1, concat_axis=g.ndim - 2, tiled=True)
        return jnp.fft.fft(g, axis=-2)

    def inverse(self, g: jax.Array) -> jax.Array:
        """(..., n, n/(2P)) complex -> (..., n/P, n) real; the dropped Nyquist column is taken as zero."""
        n = self.n
        paired = self.pair_real_transforms and g.ndim >= 3 and g.shape[-3] % 2 == 0
        if self.parts == 1 and not paired:
            return jnp.fft.irfft2(g, s=(n, n))  # pads the ky axis to n/2 + 1 with zeros
        f = jnp.fft.ifft(g, axis=-2)  # (..., n, n/(2P))
        if self.parts > 1:
            # (..., n/P, n/2)
            f = lax.all_to_all(f, self.axes, split_axis=f.ndim - 2, concat_axis=f.ndim - 1, tiled=True)
        return irfft_in_pairs(f) if paired else jnp.fft.irfft(f, n=n, axis=-1)

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


def pairs_real_transforms(mesh: Mesh) -> bool:
    """Whether the solvers on `mesh` pair their real transforms (`pair_real_transforms`): on TPUs, where XLA's real
    FFTs cost full complex ones; not on CPUs (pocketfft's are real: pairing is 1.8x slower there)."""
    return mesh.devices.flat[0].platform == "tpu"


def irfft_in_pairs(g: jax.Array) -> jax.Array:
    """(..., 2k, rows, n/2) half spectra along the last axis, Nyquist dropped -> (..., 2k, rows, n) real: fields 2i
    and 2i+1 as the real and imaginary parts of one complex inverse transform, the same as `irfft(g, n, axis=-1)`
    (which also takes the zero wavenumber's imaginary part as zero)."""
    *lead, fields, rows, m = g.shape
    g = g.reshape(*lead, fields // 2, 2, rows, m)
    a, b = g[..., 0, :, :], g[..., 1, :, :]  # (..., k, rows, m)
    zero = lax.complex(a[..., :1].real, b[..., :1].real)
    positive = jnp.concatenate([zero, a[..., 1:] + 1j * b[..., 1:]], axis=-1)  # ky = 0 .. m-1
    negative = jnp.flip(jnp.conj(a[..., 1:]) + 1j * jnp.conj(b[..., 1:]), axis=-1)  # ky = -(m-1) .. -1
    z = jnp.fft.ifft(jnp.concatenate([positive, jnp.zeros_like(zero), negative], axis=-1), axis=-1)  # (..., k, rows, n)
    return jnp.stack([z.real, z.imag], axis=-3).reshape(*lead, fields, rows, 2 * m)


def rfft_by_half_length(f: jax.Array) -> jax.Array:
    """(..., n) real -> (..., n/2) complex, `rfft(f)[..., :n/2]` (Nyquist dropped) through one complex FFT of
    length n/2: z = even samples + i odd samples, then X[k] = E[k] + w^k O[k] with E, O the even and odd samples'
    transforms recovered from Z[k] and conj(Z[-k]), w = exp(-2 pi i / n)."""
    n = f.shape[-1]
    m = n // 2
    pairs = f.reshape(*f.shape[:-1], m, 2)
    z = jnp.fft.fft(lax.complex(pairs[..., 0], pairs[..., 1]), axis=-1)  # (..., m)
    mirrored = jnp.conj(jnp.roll(jnp.flip(z, axis=-1), 1, axis=-1))  # conj(Z[(m - k) mod m])
    twiddle = jnp.asarray(-0.5j * np.exp(-2j * np.pi * np.arange(m) / n), z.dtype)  # -i/2 w^k
    return 0.5 * (z + mirrored) + twiddle * (z - mirrored)
