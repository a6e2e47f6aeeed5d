"""The int8 pool's writes by DMA (kernels/paged_attention/kv_write.py), in Pallas's TPU interpreter, against
XLA's scatters (reference.py's write_scatter): the runs a step's slots make, and the pool after a step of
decodes, prompts crossing pages and padding, equal to the last bit."""

import jax.numpy as jnp
import numpy as np
import pytest

from systolic.kernels.paged_attention import kv_write

PAGE = 128


def slots_of(rng, pages: int, decodes: int, chunks: list[tuple[int, int]]) -> list[int]:
    """Slots as the scheduler gives them: `decodes` single tokens, each in a page of its own, then chunks of
    (offset, tokens) running on into a fresh page when one fills."""
    free = list(rng.permutation(np.arange(1, pages)))
    slots = [int(free.pop()) * PAGE + int(rng.integers(0, PAGE)) for _ in range(decodes)]
    for offset, n in chunks:
        page = int(free.pop())
        for _ in range(n):
            slots.append(page * PAGE + offset)
            offset += 1
            if offset == PAGE:
                page, offset = int(free.pop()), 0
    return slots


def test_runs_of_a_step():
    # two decodes, a chunk of 5 from offset 126 (two runs: 2 tokens, then 3 in the next page), padding
    slots = [3 * PAGE + 7, 9 * PAGE + 0, 5 * PAGE + 126, 5 * PAGE + 127, 2 * PAGE, 2 * PAGE + 1, 2 * PAGE + 2, 0, 0]
    table = np.asarray(kv_write.runs(jnp.asarray(slots), 7, PAGE))
    assert table[4, 0] == 4 and table[4, 1] == 7  # runs, real tokens
    np.testing.assert_array_equal(table[:4, :4], [[0, 1, 2, 4], [1, 1, 2, 3], [3, 9, 5, 2], [7, 0, 126, 0]])
    assert not table[:4, 4:].any()  # past the last run: zero
    np.testing.assert_array_equal(table[5, :7], [3, 9, 5, 5, 2, 2, 2])
    np.testing.assert_array_equal(table[6, :7], [7, 0, 126, 127, 0, 1, 2])


@pytest.mark.parametrize("decodes, chunks, real, group", [(5, [(100, 60), (0, 3)], 60, None), (9, [(120, 12)], 21, 4)],
                         ids=["decodes-and-prompts-with-padding", "runs-in-groups-of-4"])
def test_dma_writes_equal_the_scatters(monkeypatch, decodes, chunks, real, group):
    if group:  # more runs than a group holds: the tiles of one group written before the next group reads
        monkeypatch.setattr(kv_write, "RUN_GROUP", group)
    rng = np.random.default_rng(0)
    L, pages, W, S = 2, 12, 128, 4
    slots = slots_of(rng, pages, decodes, chunks)
    T = len(slots) + 3  # with padding tokens after the real ones
    slots = jnp.asarray(slots + [0] * 3, jnp.int32)
    words = jnp.asarray(rng.integers(-2**31, 2**31 - 1, (L, pages, PAGE, W)), jnp.int32)
    scales = jnp.asarray(rng.random((L, pages, S, PAGE)), jnp.float32)
    new_words = jnp.asarray(rng.integers(-2**31, 2**31 - 1, (T, W)), jnp.int32)
    new_scales = jnp.asarray(rng.random((T, S)), jnp.float32)
    table = kv_write.runs(slots, real, PAGE)
    got_words, got_scales = kv_write.write(words, scales, 1, table, new_words, new_scales, interpret=True)
    page, offset = slots[:real] // PAGE, slots[:real] % PAGE
    want_words = words.at[1, page, offset].set(new_words[:real])
    want_scales = scales.at[1, page, :, offset].set(new_scales[:real])
    assert not np.array_equal(want_words, words) and not np.array_equal(want_scales, scales)
    np.testing.assert_array_equal(got_words, want_words)
    np.testing.assert_array_equal(got_scales, want_scales)


def test_pages_of_other_sizes_are_refused():
    words, scales = jnp.zeros((1, 2, 16, 128), jnp.int32), jnp.zeros((1, 2, 4, 16), jnp.float32)
    table = kv_write.runs(jnp.zeros(4, jnp.int32), 4, 16)
    with pytest.raises(ValueError, match="--page-size 128"):
        kv_write.write(words, scales, 0, table, jnp.zeros((4, 128), jnp.int32), jnp.zeros((4, 4)), interpret=True)


def test_int8_writes_split_over_heads_equal_one_device(monkeypatch):
    """In a TPU program, `write_kv` writes an int8 pool through the kernel, per device in a shard_map over the heads
    (each device its heads' words and scales). The kernel's place is taken by the scatters it replaces (the
    interpreter over several devices waits forever on its barriers): what is checked is the split."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax
    from systolic.runtime.sharding import activate
    from systolic.kernels.paged_attention import int8_pool
    from systolic.kernels.paged_attention import paged_kv as pa

    def scatters(words, scales, layer, table, new_words, new_scales, interpret):
        real = table[4, 1]
        keep = jnp.arange(new_words.shape[0]) < real
        page, offset = jnp.where(keep, table[5], 0), jnp.where(keep, table[6], 0)  # padding: the null page
        return words.at[layer, page, offset].set(new_words), scales.at[layer, page, :, offset].set(new_scales)

    calls = []
    monkeypatch.setattr(pa, "compile_platform", lambda: "tpu")
    monkeypatch.setattr(pa.kv_write, "write", lambda *a, **k: calls.append(1) or scatters(*a, **k))
    rng = np.random.default_rng(0)
    KV, hd, pages = 8, 64, 9  # each device a whole packing unit of its row (512 entries)
    pool = int8_pool.quantize_pool(jnp.asarray(rng.normal(size=(2, pages, PAGE, KV * 2 * hd)), jnp.float32), hd)
    k, v = (jnp.asarray(rng.normal(size=(6, KV, hd)), jnp.float32) for _ in range(2))
    slots = jnp.asarray(slots_of(rng, pages, 2, [(126, 4)]), jnp.int32)
    write = jax.jit(lambda pool, k, v: pa.write_kv(pool, 1, k, v, slots, 6))
    want = write(pool, k, v)
    assert calls and not np.array_equal(want.words, pool.words)
    mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
    with activate(mesh, (("heads", "tensor"), ("kv_heads", "tensor"))):
        split = int8_pool.Int8Pool(jax.device_put(pool.words, NamedSharding(mesh, P(None, None, None, "tensor"))),
                                   jax.device_put(pool.scales, NamedSharding(mesh, P(None, None, "tensor", None))),
                                   pool.unit)
        heads = NamedSharding(mesh, P(None, "tensor", None))
        got = write(split, jax.device_put(k, heads), jax.device_put(v, heads))
    assert got.words.sharding.spec[3] == "tensor"  # split as it came
    np.testing.assert_array_equal(got.words, want.words)
    np.testing.assert_array_equal(got.scales, want.scales)


def test_the_run_table_is_made_once_a_step_for_pools_written_by_dma(monkeypatch):
    """A step's PagedKV carries the run table where kv_write.py writes its pool (an int8 key/value pool in a
    TPU program), so the layers (a scan on the chip) do not each sort the slots again; none for other pools."""
    from types import SimpleNamespace

    from systolic.kernels.paged_attention import int8_pool
    from systolic.kernels.paged_attention import paged_kv as pa

    monkeypatch.setattr(pa, "compile_platform", lambda: "tpu")
    rng = np.random.default_rng(0)
    batch = SimpleNamespace(slots=jnp.asarray(slots_of(rng, 9, 3, [(120, 12)]), jnp.int32), num_tokens=jnp.int32(13))
    pool = int8_pool.quantize_pool(jnp.zeros((2, 9, PAGE, 8 * 2 * 64), jnp.float32), 64)
    got = pa.PagedKV(pool, 0, batch).with_write_runs().write_runs
    np.testing.assert_array_equal(got, kv_write.runs(batch.slots, 13, PAGE))
    assert pa.PagedKV(jnp.zeros((2, 9, 16, 1024), jnp.bfloat16), 0, batch).with_write_runs().write_runs is None
    latent = int8_pool.Int8Pool(jnp.zeros((2, 9, PAGE, 128), jnp.int32), jnp.zeros((2, 9, 1, PAGE)), 512)  # MLA's
    assert pa.PagedKV(latent, 0, batch).with_write_runs().write_runs is None
