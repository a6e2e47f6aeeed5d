"""Sizes a user sets are checked against memory before anything is traced (runtime/memory.py's check_fits): an lm's
activations with a huge LoRA rank, eval lm's batch, a gan evaluation's sample, serve's KV pool; and an SFT record
is bounded in messages. Each is one UserError paragraph with the estimate and what to lower."""

import json

import jax
import pytest

from systolic import config as config_lib
from systolic import workloads
from systolic.data import sft
from systolic.data.tokenizer import ByteTokenizer
from systolic.errors import UserError
from systolic.runtime import memory
from systolic.workloads.gan import train as gan_train
from systolic.workloads.lm import preflight
from systolic.workloads.lm.model import sizes
from systolic.workloads.lm.serve import sizing

BUDGET = 23 * 2**30  # this machine's RAM, whatever runs the test


def load(workload: str, overrides: list[str]):
    w = workloads.get(workload)
    return config_lib.load(w.config, None, overrides, w.default_recipe, workload)[0]


def test_a_huge_lora_rank_is_refused_for_its_activations():
    cfg = load("lm", ["model.lora.rank=1000000", "init.from=runs/base"])
    # The adapters alone (2.6e9 parameters, 31 GiB with gradients and moments) are not the whole story: each layer
    # keeps x A, (tokens, rank) per adapted projection, for B's gradient.
    assert sizes.activation_floats(cfg.model) >= cfg.model.layers * 2 * 1_000_000
    with memory.budget(BUDGET, "23 GiB of test budget"), pytest.raises(UserError) as raised:
        preflight.check_training_fits(cfg, 258, jax.devices())
    message = str(raised.value)
    assert "needs at least" in message and "model.lora.rank" in message and "model.remat=full" in message
    rematted = load("lm", ["model.lora.rank=8", "init.from=runs/base", "model.remat=full"])
    assert sizes.activation_floats(rematted.model) < sizes.activation_floats(load("lm", []).model)


def test_a_gan_evaluation_sample_is_sized_with_the_generators_activations():
    cfg = load("gan", ["gan.eval_samples=100000000"])
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    assert gan_train.sample_floats(cfg, 1) > cfg.image.size**2  # more than the pixels alone
    with memory.budget(BUDGET, "23 GiB of test budget"), pytest.raises(UserError, match="gan.eval_samples=100000000"):
        gan_train.check_fits(cfg, 1, {}, mesh)


def test_a_gan_evaluation_estimate_covers_its_measured_peak():
    # Peak RSS of `train gan` (2026-12-06, 8x8 digits): model.g_channels=32, 22.2 KiB more per generated image from
    # 40,000 to 160,000 samples; the default g_channels=128, about 120 KiB per image at 30,000. The 2,000,000
    # samples at width 32 were estimated at 15 GB, passed this 23 GiB machine's check and were killed: now refused.
    for width, measured_kib in ((32, 22.2), (128, 120)):
        cfg = load("gan", [f"model.g_channels={width}", "gan.eval_samples=2000000"])
        assert 4 * gan_train.sample_floats(cfg, 1) >= measured_kib * 1024
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    cfg = load("gan", ["model.g_channels=32", "model.latent_dim=8", "gan.eval_samples=2000000"])
    with memory.budget(BUDGET, "23 GiB of test budget"), pytest.raises(UserError, match="gan.eval_samples=2000000"):
        gan_train.check_fits(cfg, 1, {}, mesh)


def test_a_kv_pool_over_memory_is_refused():
    model = load("lm", []).model
    with memory.budget(BUDGET, "23 GiB of test budget"), pytest.raises(UserError) as raised:
        sizing.pool_pages(model, 16, kv_memory_gib=1e5, max_seqs=8, device=jax.devices()[0], split=1)
    assert "--kv-memory-gib" in str(raised.value) and "needs at least" in str(raised.value)
    with memory.budget(BUDGET, "23 GiB of test budget"), pytest.raises(UserError, match="--max-seqs"):
        sizing.pool_pages(model, 16, kv_memory_gib=0.01, max_seqs=10**12, device=jax.devices()[0], split=1)


def test_an_sft_record_of_too_many_messages_is_refused_by_line(tmp_path):
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(sft.MAX_MESSAGES + 1)]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"prompt": "2 + 2 =", "completion": " 4"}) + "\n" + json.dumps({"messages": turns}) + "\n")
    with pytest.raises(UserError, match=rf"chats.jsonl line 2 has {sft.MAX_MESSAGES + 1} messages"):
        sft.load_chat_corpus(str(path), ByteTokenizer(), seq_len=64, val_percent=10)


def test_an_sft_line_longer_than_the_bound_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(sft, "MAX_RECORD_BYTES", 1000)
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 5000, "completion": "y"}) + "\n")
    with pytest.raises(UserError, match="line 1 is longer than"):
        list(sft.read_records(str(path)))
