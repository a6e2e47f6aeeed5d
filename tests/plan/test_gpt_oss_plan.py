"""The gpt-oss-20b recipe in `systolic plan`: its sizes, the training FLOPs of half its layers sliding, the serving
plan's keys per layer (a sliding layer reads only its window's pages) and the attention choice with sinks (the XLA
formulation, whose FLOPs XLA counts)."""

import dataclasses

import jax
import pytest

from systolic import config as config_lib
from systolic import workloads
from systolic.plan import targets
from systolic.plan.serving import Compile, decode_roofline
from systolic.workloads.lm.model import attention, flops, sizes
from tiny import TINY_LM


def recipe(*overrides: str):
    w = workloads.get("lm")
    return config_lib.load(w.config, "gpt-oss-20b", list(overrides), w.default_recipe)[0]


def test_the_recipe_is_gpt_oss_20b_shaped():
    cfg = recipe()
    m = cfg.model
    vocab = m.padded_vocab(0)
    assert vocab == 201088 and m.local_layers == (True, False) * 12 and m.attn_sinks and m.moe.swiglu_limit == 7.0
    # The model card's 21B total and 3.6B active parameters (norms, biases and sinks left out of both counts).
    assert 20.8e9 < sizes.param_count(m, vocab) < 21.0e9
    assert 3.5e9 < flops.matmul_params(m, vocab) < 3.7e9
    # Half the layers see at most 128 keys: their attention term is W - W^2 / 2T keys a query, not T / 2.
    T, W = cfg.data.seq_len, m.sliding_window
    attention_flops = 12 * (12 * T / 2 + 12 * (W - W**2 / (2 * T))) * m.heads * m.d_head
    assert flops.train_flops_per_token(m, vocab, T) == pytest.approx(6 * flops.matmul_params(m, vocab) + attention_flops)
    # Sinks: the plain XLA formulation on every platform (so the plan adds no kernel FLOPs to XLA's count).
    assert attention.choose("auto", dtype=jax.numpy.bfloat16, head_dim=64, seq_len=T, sinks=True) == "xla"


def test_serving_keys_per_layer_count_the_windows():
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.serve.planned_step import serve_model

    overrides = [*TINY_LM, "model.attn_sinks=true", "model.sliding_window=4", "model.layer_types=[sliding,full]"]
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))
    m = serve_model(cfg, jax.devices()[:1], weights="bf16", kv="bf16", page_size=16)
    assert (m.window, m.window_share) == (4, 0.5)
    chip = targets.resolve("v5e-4", mesh_devices=0).chip
    c = Compile(sequences=8, prefill_tokens=0, pool_pages=64, fits=True, peak_bytes=0, pool_bytes=0, temp_bytes=None,
                out_of_memory=None, compile_s=0.0, ici_wire_bytes=0.0, collectives={}, xla_flops=None,
                attention_kernel=False)
    full = decode_roofline(dataclasses.replace(m, window=0), chip, 1, 8, 1000, c)
    windowed = decode_roofline(m, chip, 1, 8, 1000, c)
    # 1000 keys on the full layer, 4 on the sliding one: (1000 + 4) / 2 a layer on average.
    per_key = 8 * m.attention_flops_per_key
    assert full.flops - windowed.flops == pytest.approx(per_key * (1000 - 502))
    assert full.hbm_bytes_per_chip - windowed.hbm_bytes_per_chip == pytest.approx(
        8 * (1000 - 502) * m.kv_bytes_per_token_per_chip)
