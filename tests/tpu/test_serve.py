"""The inference engine on the chip against the same engine on the host's CPU: the greedy tokens of four prompts, two
arriving late, with llama-1b's head_dim of 64 (the pool's [k | v] rows are 128 lanes,
kernels/paged_attention/pool.py), prompts that cross a 256-key block and one longer than a step (chunked), steps
launched before the last one's tokens are read (serve/engine.py). In float32 at 'highest' matmul precision the two
agree on every token; in bfloat16 (weights stored bf16, serve/weights.py) they agree until the first near-tie of two
logits, where the chip's and the CPU's roundings may choose differently: each prompt's agreeing prefix is recorded
(the `agreeing_tokens_*` properties in the junit XML)."""

import jax
import numpy as np
import pytest
from tiny_serve import drive, random_params, tiny_model, token_ids

from systolic.data.tokenizer import ByteTokenizer
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams

pytestmark = pytest.mark.tpu

NEW = 48
MODEL = ("model.d_model=256", "model.heads=4", "model.kv_heads=2", "model.max_seq_len=512")  # head_dim 64
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(0, 256, n).tolist() for n in (5, 100, 300, 37)]  # 300: over a 128-token step
ARRIVALS = (0, 0, 1, 3)  # the step before which each arrives


def greedy(dtype: str, device: jax.Device, model=MODEL, kv_cache: str = "auto", page_size: int = 16) -> list[list[int]]:
    cfg = tiny_model(*model, f"model.dtype={dtype}")
    _, params = random_params(cfg, std=0.05)
    with jax.default_device(device):
        engine = InferenceEngine(cfg, jax.device_put(params, device), ByteTokenizer(), kv_pages=128,
                                 page_size=page_size, max_seqs=4, max_tokens_per_step=128, kv_cache=kv_cache)
        arrivals: dict[int, list] = {}
        for i, step in enumerate(ARRIVALS):
            params_i = SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=())
            arrivals.setdefault(step, []).append((f"r{i}", PROMPTS[i], params_i))
        events = drive(engine, arrivals)
    return [token_ids(events[f"r{i}"]) for i in range(len(PROMPTS))]


def agreeing(a: list[int], b: list[int]) -> int:
    """The length of the common prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_greedy_tokens_on_the_chip_are_the_cpus(chip, host, record_property):
    with jax.default_matmul_precision("highest"):
        on_chip, on_host = greedy("float32", chip), greedy("float32", host)
    assert all(len(t) == NEW for t in on_host) and len({tuple(t) for t in on_host}) == len(PROMPTS)
    record_property("agreeing_tokens_float32", str([agreeing(a, b) for a, b in zip(on_chip, on_host)]))
    assert on_chip == on_host
    bf16 = [agreeing(a, b) for a, b in zip(greedy("bfloat16", chip), greedy("bfloat16", host))]
    record_property("agreeing_tokens_bfloat16", str(bf16))
    assert sum(bf16) >= len(PROMPTS), bf16  # a near-tie may come early, not at every prompt's first token


def test_greedy_tokens_over_an_int8_pool_on_the_chip_are_the_cpus(chip, host, record_property):
    """The same over an int8 pool (`--kv-cache int8`) in pages of 128: on the chip the kernel reads it and
    kernels/paged_attention/kv_write.py writes it by DMA (4 key/value heads of 64: a row of 512 entries, the kernels'
    packing unit), on the CPU XLA's gathers and scatters. float32 keys and values quantized on two machines may round
    an entry apart and move a logit by its step, so agreement is counted: broken writes would part the tokens at the
    second (the first comes from the prompt's own keys, not the pool)."""
    model = ("model.d_model=512", "model.heads=8", "model.kv_heads=4", "model.max_seq_len=512")
    with jax.default_matmul_precision("highest"):
        on_chip, on_host = (greedy("float32", d, model, kv_cache="int8", page_size=128) for d in (chip, host))
    agree = [agreeing(a, b) for a, b in zip(on_chip, on_host)]
    record_property("agreeing_tokens_int8_pool", str(agree))
    assert sum(agree) >= 3 * NEW * len(PROMPTS) // 4, agree
