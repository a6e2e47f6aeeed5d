"""`systolic plan lm --serve`: the inference engine's step compiled for a target without running it, and the
serving figures read from it."""

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tiny import TINY_LM

# The CLI on TINY_LM (its data.seq_len within the model's 32 positions), as a user passes overrides.
SERVE = ["plan", "lm", "--serve", *TINY_LM]


def serve_model(overrides: list[str], *, weights: str, kv: str, devices: int = 2):
    from systolic import config as config_lib
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.serve.planned_step import serve_model

    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))
    return cfg, serve_model(cfg, jax.devices()[:devices], weights=weights, kv=kv, page_size=16)


def test_the_step_bans_ids_without_copying_the_logits():
    """The engine's step keeps banned ids (min_tokens' stop ids) from being sampled with a mask compared in place,
    not a scatter into a copy of the logits (S, V): one more whole-vocabulary float32 array a step, 68 MB for
    gemma3-1b at 64 sequences. With that and the chosen id's log-probability taken without jax.nn.log_softmax's
    (S, V) result, XLA's bytes accessed for that step on a v5e went 4.35 -> 3.65 GB. Here: XLA:CPU's program for a
    tiny model, which scattered into a copy of the logits before."""
    cfg, m = serve_model([*TINY_LM, "model.dtype=float32"], weights="bf16", kv="bf16", devices=1)
    hlo = m.lower_step(3, 0, 7).compile().as_text()  # 3 rows (3 decoding sequences, no prompt)
    logits = f"f32[3,{cfg.model.padded_vocab(cfg.model.vocab_size or 320)}]"
    assert f"= {logits}" in hlo, "no (rows, vocabulary) logits in the compiled step"
    assert not [line for line in hlo.splitlines() if f"= {logits}" in line and ("scatter" in line or " copy(" in line)]


def test_a_greedy_step_without_banned_ids_skips_the_mask():
    """The (rows, vocabulary) mask of banned ids is built only in the branches that use it: the sampling branch, and
    in the all-greedy branch (lax.cond's true branch, `branch_1`) only inside its own conditional taken when some row
    bans an id: the compares took 0.18 ms of gemma3-1b's 6.8 ms step at 64 rows on a v5e when no row banned any
    (2026-12-07 profile). Here: XLA:CPU's program for a tiny model, each compare's place from its op_name."""
    cfg, m = serve_model([*TINY_LM, "model.dtype=float32"], weights="bf16", kv="bf16", devices=1)
    hlo = m.lower_step(3, 0, 7).compile().as_text()
    V = cfg.model.padded_vocab(cfg.model.vocab_size or 320)
    names = [re.search(r'op_name="([^"]*)"', line).group(1) for line in hlo.splitlines()
             if re.search(rf"= pred\[3,{V}\]\S* (compare|or)\(", line)]
    greedy = [n for n in names if re.match(r"[^/]*/cond/branch_1_fun/", n)]  # the step's own cond's true branch
    assert greedy, "no mask in the greedy branch of the compiled step"
    assert all("/cond/branch_" in n for n in names), names  # none before the branches
    assert all(re.match(r"[^/]*/cond/branch_1_fun/cond/branch_\d_fun/", n) for n in greedy), greedy


def test_kv_bytes_per_token_are_the_formula_and_the_compiled_pools():
    cfg, m = serve_model([*TINY_LM, "model.dtype=bfloat16"], weights="bf16", kv="bf16")
    L, KV, hd = cfg.model.layers, cfg.model.n_kv_heads, cfg.model.d_head
    assert m.kv_bytes_per_token == 2 * L * KV * hd * 2 == 128
    assert (m.kv_split, m.kv_bytes_per_token_per_chip) == (2, 64)  # 2 KV heads over 2 devices
    pool = m.lower_step(3, 0, 7).args_info[0][1]  # the lowered step's pool argument: 7 pages of 16 tokens
    assert pool.shape[1:3] == (7, 16)
    assert math.prod(pool.shape) * pool.dtype.itemsize == 7 * 16 * m.kv_bytes_per_token
    _, q = serve_model([*TINY_LM, "model.dtype=bfloat16"], weights="bf16", kv="int8")
    # int8 values and one float32 scale per token, layer, key or value and head, as the lowered pool holds them
    assert q.kv_bytes_per_token == 2 * L * KV * (hd + 4)
    pool = q.lower_step(3, 0, 7).args_info[0][1]  # the pool: an Int8Pool of words and scales
    words, scales = pool.words, pool.scales
    assert words.dtype == jnp.int32 and words.shape[-1] == KV * 2 * hd // 4  # four int8 entries a word
    assert scales.shape == (*words.shape[:2], 2 * KV, words.shape[2])  # each head's key's and value's, positions minor
    lowered = sum(math.prod(a.shape) * a.dtype.itemsize for a in (words, scales))
    assert lowered == 7 * 16 * q.kv_bytes_per_token


LLAMA_8B = ["model.family=llama", "model.d_model=4096", "model.layers=32", "model.heads=32", "model.kv_heads=8",
            "model.mlp_dim=14336", "model.vocab_size=128256", "model.scan_layers=true", "model.max_seq_len=2048"]


def test_int8_weights_are_half_the_bytes_but_the_embedding_and_scales():
    """Llama-3-8B's shape, abstract (nothing allocated): bf16 is 2 bytes a parameter (the norms' scales 4); int8
    stores the projections and the untied LM head in 1 byte plus a scale per output channel, the embedding table
    stays bf16."""
    _, bf16 = serve_model(LLAMA_8B, weights="bf16", kv="bf16", devices=8)
    _, int8 = serve_model(LLAMA_8B, weights="int8", kv="bf16", devices=8)
    norms = 32 * 2 * 4096 + 4096  # float32
    assert 8.0e9 < bf16.params < 8.1e9 and bf16.weight_bytes == 2 * bf16.params + 2 * norms
    embedding, layers, d, vocab = 128256 * 4096, 32, 4096, 128256
    projections = bf16.params - embedding - norms
    # scales: one per output channel of each projection (per layer) and of the head, in the weights' bfloat16 (Qwix
    # keeps the dtype it quantized from)
    channels = layers * (32 * 128 + 2 * 8 * 128 + d + 2 * 14336 + d) + vocab
    assert int8.weight_bytes == 2 * (bf16.params - projections) + 2 * norms + projections + 2 * channels
    assert 0.53 < int8.weight_bytes / bf16.weight_bytes < 0.54
    assert int8.weight_bytes_per_chip < 0.55 * bf16.weight_bytes_per_chip
    _, w8a8 = serve_model(LLAMA_8B, weights="w8a8", kv="bf16", devices=8)  # the same weights, int8 x int8 dots
    assert (w8a8.weight_bytes, w8a8.int8_matmuls, int8.int8_matmuls) == (int8.weight_bytes, True, False)


LLAMA_1B = ["model.family=llama", "model.d_model=2048", "model.layers=16", "model.heads=32", "model.kv_heads=8",
            "model.mlp_dim=8192", "model.vocab_size=32768", "model.tie_embeddings=true", "model.scan_layers=true",
            "model.max_seq_len=2048"]


def test_the_v5e_decode_step_is_priced_at_the_measured_rates():
    """llama-1b as `benchmarks/harness/tpu.sh serve` ran it (vocabulary 32,768) decoding 64 sequences of 192 tokens on a
    v5e: 2.08 GB of weights at 812 GB/s and 16 layers at 29.5 us, then one 256-key block of keys and values a
    sequence and layer at the kernel's 440 GB/s (heads of 64), then 64 tokens' matmuls at 181 TFLOP/s: 4.99 ms,
    where the chip took 5.14 ms a token (TPOT p50, 2026-12-07) and the roofline says 3.03 ms. Only what was measured is priced:
    not an int8 pool's plain attention path, int8 weights or another chip."""
    from systolic.plan import targets
    from systolic.plan.serving import Compile, _unmeasured, decode_roofline, expected_decode

    _, m = serve_model([*LLAMA_1B, "model.dtype=bfloat16"], weights="bf16", kv="bf16", devices=1)
    chip = targets.CHIPS["v5e"]
    step = Compile(sequences=64, prefill_tokens=192, pool_pages=769, fits=True, peak_bytes=0, pool_bytes=0,
                   temp_bytes=None, out_of_memory=None, compile_s=0.0, ici_wire_bytes=0.0, collectives={},
                   xla_flops=None, attention_kernel=True)
    matmul_params = 16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192) + 32768 * 2048  # the LM head: tied
    assert m.weight_read_bytes_per_chip == 2 * matmul_params + 4 * (2 * 16 + 1) * 2048  # norms in float32
    assert m.kernel_block_keys == 256 and m.kv_bytes_per_token == 2 * 16 * 8 * 64 * 2
    by_hand = (m.weight_read_bytes_per_chip / 812e9 + 16 * 29.5e-6 + 64 * 256 * 32768 / 440e9
               + 64 * 2 * matmul_params / 181e12)
    e = expected_decode(m, chip, 1, 64, 192, step)
    assert e.step_s == pytest.approx(by_hand) == pytest.approx(4.99e-3, abs=0.01e-3)
    assert e.keys == 256 and "blocks of 256" in e.note and "440 GB/s" in e.note
    assert decode_roofline(m, chip, 1, 64, 192, step).step_s == pytest.approx(3.03e-3, abs=0.01e-3)
    # Any context up to one block reads the same: the kernel takes a block's rest from the null page.
    longer = expected_decode(m, chip, 1, 64, 257, step)  # two blocks
    assert expected_decode(m, chip, 1, 64, 129, step).step_s == e.step_s and longer.kv_s == pytest.approx(2 * e.kv_s)
    assert _unmeasured(m, chip, step) is None
    assert "plain path" in _unmeasured(m, chip, dataclasses.replace(step, attention_kernel=False))
    assert "int8 weights" in _unmeasured(dataclasses.replace(m, weights="int8"), chip, step)
    assert "no serving step was measured" in _unmeasured(m, targets.CHIPS["v6e"], step)
    assert "int8 KV pool" in _unmeasured(dataclasses.replace(m, kv="int8"), chip, step)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # Standard dtype promotion, as a user runs it (the GPU stand-in traces bfloat16 code, see test_planner.py).
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUMPY_DTYPE_PROMOTION")}
    return subprocess.run([sys.executable, "-m", "systolic", *args], capture_output=True, text=True, timeout=900,
                          env=env)


def test_tiny_model_on_the_gpu_stand_in_prints_and_prices():
    proc = run_cli(*SERVE, "--target", "h100", "--mesh", "tensor=2", "--batch", "4", "--weights", "bf16,int8",
                   "--kv", "bf16", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (r["chips"], r["tensor"], r["replicas"]) == (2, 2, 1) and "XLA:CPU" in r["compiler"]
    bf16, int8 = r["plans"]
    for p in (bf16, int8):
        assert p["fits"] and p["step"]["fits"] and p["step"]["sequences"] == 4 and p["step"]["prefill_tokens"] == 32
        assert p["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 2  # the model's float32 on CPU is bf16 on the GPU
        assert p["sequences"] == 4 and "room for about" in p["sequences_from"] and p["decode_roofline"]["step_s"] > 0
        assert p["usd_per_million_output_tokens"] == pytest.approx(
            r["price_per_chip_hour"] * 2 / (p["output_tokens_per_s_per_slice"] * 3600) * 1e6)
    assert int8["weight_bytes"] < bf16["weight_bytes"]
    text = run_cli(*SERVE, "--target", "h100", "--batch", "4", "--weights", "bf16", "--kv", "bf16,int8")
    assert text.returncode == 0, text.stderr
    assert "bf16     int8 " in text.stdout and "compiled bf16 weights, int8 KV" in text.stdout


def test_a_model_too_big_is_a_result_not_a_crash():
    """A 68B-parameter model on one H100: exit 0, and the plan says it does not fit."""
    proc = run_cli("plan", "lm", "--serve", "model.d_model=16384", "model.layers=16", "model.heads=128",
                   "model.kv_heads=8", "model.mlp_dim=65536", "model.scan_layers=true", "model.max_seq_len=256",
                   "data.seq_len=256", "--target", "h100", "--weights", "bf16", "--kv", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert "DOES NOT FIT" in proc.stdout and "not one sequence of 256 tokens fits beside the weights" in proc.stdout


def test_serving_options_need_serve():
    proc = run_cli("plan", "lm", "--recipe", "lm-tiny", "--target", "v5e-4", "--kv", "int8")
    assert proc.returncode == 2 and "--kv describe a serving plan, but --serve is not set" in proc.stderr


@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]'): no TPU compiler to plan with")
def test_tiny_model_on_a_v5e_4_compiles_tensor_parallel():
    proc = run_cli(*SERVE, "--target", "v5e-4", "--batch", "8", "--weights", "int8", "--kv", "bf16", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    (p,) = r["plans"]
    assert r["topology"] == "v5e:2x2" and r["tensor"] * r["replicas"] == 4
    assert p["step"]["fits"] and p["step"]["collectives"]["all-reduce"] > 0  # the row-parallel projections
    assert 0 < p["step"]["peak_bytes"] < 16 * 2**30 and p["sequences"] == 8


@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]'): no TPU compiler to plan with")
def test_a_v5e_plan_finds_the_kernel_and_its_tokens_follow_the_expected_step():
    """The compiled step's attention is the Pallas kernel (heads of 64, bf16 pool), so the plan prices the decode
    step at the v5e's measured rates, and its tokens/s and price follow that step, not the roofline."""
    proc = run_cli(*SERVE, "model.dtype=bfloat16", "model.d_model=512", "model.heads=8", "model.kv_heads=8",
                   "model.max_seq_len=256", "model.tie_embeddings=true", "--target", "v5e-1", "--context", "192",
                   "--batch", "8", "--weights", "bf16", "--kv", "bf16", "--json")
    assert proc.returncode == 0, proc.stderr
    (p,) = json.loads(proc.stdout.strip().splitlines()[-1])["plans"]
    e = p["decode_expected"]
    assert p["step"]["attention_kernel"] and p["unmeasured"] is None
    assert e["weights_s"] == pytest.approx(p["weight_bytes_per_chip"] / 812e9)  # tied: the LM head reads the table
    assert e["layers_s"] == pytest.approx(2 * 29.5e-6)
    assert e["kv_s"] == pytest.approx(8 * 256 * p["kv_bytes_per_token"] / 440e9)
    parts = e["weights_s"] + e["layers_s"] + e["kv_s"] + e["matmul_s"]
    assert e["step_s"] == pytest.approx(parts) and e["step_s"] > p["decode_roofline"]["step_s"]
    assert p["output_tokens_per_s_per_chip"] == pytest.approx(8 / e["step_s"])


@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]'): no TPU compiler to plan with")
@pytest.mark.parametrize("heads, kv_heads, kv", [(8, 8, "bf16"), (8, 2, "bf16"), (4, 4, "int8"), (8, 8, "int8")])
def test_the_tpu_step_updates_its_pool_in_place_through_the_kernel(heads, kv_heads, kv):
    """The donated pool is aliased to the step's output and never copied, and the step's attention is the Pallas
    kernel: with heads 64 wide (llama-1b's) the former (..., 2 x KV, 64) layout made the TPU compiler store it
    pages-minor and copy it into and out of the layers' loop, 2 x 2.1 GB a step for llama-1b's 4,099 pages
    (docs/performance.md, "Serving on one v5e"); (..., KV, 128) rows were still relaid out once a step with 2 key/value
    heads (Qwen2.5-0.5B's shape). An int8 pool goes through the kernel too, in pages of 128 (`systolic serve`'s
    default for it on a TPU), its scales (L, pages, 2 KV, 128) stored row-major and handed to the kernel whole: in
    pages of 16 as (L, pages, 16, 2 KV) the compiler stored them pages-minor and relaid them out for every call
    (llama-1b w8a8, 64 in flight, v5e: 70.9 ms a step, 36.5 with one layer's, 4.47 over bfloat16 pages); the plain
    path's gather of every token's pages took a Llama-3-8B shape's 1,024-token step to 16.65 GiB of temporaries.
    Compiled with libtpu for a v5e chip, 2 layers x 512 (8 heads of 64 with 8 or 2 key/value heads; 4 of 128)."""
    from systolic import config as config_lib
    from systolic.plan import targets
    from systolic.plan.planner import compile_lowered, devices_for, for_target
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.serve.planned_step import serve_model

    target = targets.resolve("v5e-1", mesh_devices=1)
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [
        *TINY_LM, "model.dtype=bfloat16", "model.d_model=512", f"model.heads={heads}", f"model.kv_heads={kv_heads}",
        "model.max_seq_len=256"]))
    # 2^20 positions (a 2-4 GB pool): a small pool's scales were put in on-chip memory, where the compiler wrote them
    # in another layout and copied them in and out; at a pool's usual size they stay in HBM, written in place.
    page = 128 if kv == "int8" else 16
    pages = 2**20 // page
    with for_target(target):
        m = serve_model(cfg, devices_for(target), weights="bf16", kv=kv)  # serve's default pages
        assert m.page_size == page
        compiled, refused = compile_lowered(m.lower_step(8, 0, pages), target)  # without the persistent cache
        if kv == "int8":  # and a step of 1,024 tokens (their scales once cost a copy of every layer's: SCALE_WRITES)
            big, refused_big = compile_lowered(m.lower_step(1024, 8, pages), target)
            scale_bytes = 2**20 * 4 * 2 * cfg.model.n_kv_heads * cfg.model.layers
            assert refused_big is None and big.memory_analysis().temp_size_in_bytes < scale_bytes / 8
    assert refused is None, refused
    pool_bytes = pages * page * m.kv_bytes_per_token
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= pool_bytes  # donated: the output is the input's memory
    assert memory.temp_size_in_bytes < pool_bytes / 8, memory.temp_size_in_bytes  # no copy of it
    model = cfg.model
    L, KV = model.layers, model.n_kv_heads
    shapes = [f"{'s32' if kv == 'int8' else 'bf16'}[{L},{pages},{page},{KV * 2 * model.d_head // (4 if kv == 'int8' else 1)}]"]
    if kv == "int8":
        shapes.append(f"f32[{L},{pages},{2 * KV},{page}]")
    text = compiled.as_text()
    copies = [line for line in text.splitlines() if " copy(" in line and any(s in line.split("=")[1] for s in shapes)]
    assert not copies, copies[:2]
    assert "systolic_paged_attention" in text  # the kernel (kernels/paged_attention/kernel.py), not the plain gather
    # an int8 pool written by DMA (kernels/paged_attention/kv_write.py)
    assert ("systolic_kv_write" in text) == (kv == "int8")
    if kv == "int8":  # every layer's scales, row-major: the stored array itself, no relayout (docstring)
        call = next(line for line in text.splitlines() if "= " in line and "systolic_paged_attention" in line
                    and "custom-call(" in line)
        constraints = call.split("operand_layout_constraints={")[1].split("}}")[0]
        assert f"{shapes[1]}{{3,2,1,0" in constraints, constraints
        assert f"{shapes[1]}{{3,2,1,0" in text.splitlines()[0]  # the entry's layout: as the kernel reads it


@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]'): no TPU compiler to plan with")
@pytest.mark.parametrize("weights", ["w8a8", "int8"])
def test_the_tpu_step_reads_int8_weights_without_copying_their_slices(weights, monkeypatch):
    """Quantized weights stacked by layer are served with their scales in bfloat16 (serve/weights.py): with float32
    scales the TPU compiler copied each layer's int8 weight slices into on-chip memory before their dots, one after
    the other (on a v5e: w8a8 1.11x bfloat16 at 256 in flight, where a scan of its MLPs alone ran 1.66x). Compiled
    with libtpu for a v5e chip, 2 scanned layers x 512 (MLP 2,048): no such copy, where the float32 scales make one
    per weight."""
    from systolic import config as config_lib
    from systolic.plan import targets
    from systolic.plan.planner import compile_lowered, devices_for, for_target
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.model import quant
    from systolic.workloads.lm.serve import planned_step, weights as weights_lib

    target = targets.resolve("v5e-1", mesh_devices=1)
    cfg = config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, [
        *TINY_LM, "model.dtype=bfloat16", "model.d_model=512", "model.heads=8", "model.kv_heads=8",
        "model.mlp_dim=2048", "model.max_seq_len=256", "model.scan_layers=true"]))

    def weight_copies() -> int:
        with for_target(target):
            m = planned_step.serve_model(cfg, devices_for(target), weights=weights, kv="bf16", page_size=16)
            compiled, refused = compile_lowered(m.lower_step(64, 0, 1024), target)
        assert refused is None, refused
        return len(re.findall(r"dynamic-slice\S* = s8\[", compiled.as_text()))  # a layer's slice, on its own

    assert weight_copies() == 0
    served = weights_lib.serving_params

    def float32_scales(params, dtype):  # as served, but each quantized weight keeps its float32 scales
        return jax.tree.map(lambda s, p: dataclasses.replace(s, scale=p.scale) if quant.is_quantized(s) else s,
                            served(params, dtype), params, is_leaf=quant.is_quantized)

    monkeypatch.setattr(weights_lib, "serving_params", float32_scales)
    assert weight_copies() > 0
