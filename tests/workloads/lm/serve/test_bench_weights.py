"""benchmarks/studies/serve_engine.py's random weights, drawn as served: with `--quantize` the tree is exactly what
`systolic serve --quantize` serves (quant.quantize_params of float32 weights, the rest in the compute dtype), each
quantized weight has the float weights' spread, and the engine serves them: greedy tokens equal `generate`'s."""

import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny_serve import LIMIT, PAGE, VOCAB, random_params, tiny_model

from systolic.data.tokenizer import ByteTokenizer
from systolic.workloads.lm.model import decode as gen
from systolic.workloads.lm.model import quant
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams
from systolic.workloads.lm.serve.weights import serving_params
from systolic.workloads.lm.model.build import model_graphdef

BENCHMARK = Path(__file__).parents[4] / "benchmarks" / "studies" / "serve_engine.py"


def _bench():
    spec = importlib.util.spec_from_file_location("serve_engine", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("scheme", ["int8", "w8a8", None])
def test_drawn_weights_have_the_served_tree(scheme):
    bench = _bench()
    cfg = tiny_model("model.scan_layers=true", "model.dtype=bfloat16")
    floats = random_params(cfg)[1]
    want = quant.quantize_params(floats, scheme, stacked=True) if scheme else floats
    want = serving_params(want, jnp.bfloat16)
    got = bench.random_params(cfg, VOCAB, scheme)
    assert jax.tree.structure(got) == jax.tree.structure(want)  # a QArray's qtype is part of its structure
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert got["embed"].dtype == jnp.bfloat16 and got["blocks"]["attn_norm"]["scale"].dtype == jnp.float32
    w_up = got["blocks"]["mlp"]["w_up"]
    if scheme:
        assert w_up.qvalue.dtype == jnp.int8 and w_up.scale.shape == (cfg.layers, 1, w_up.shape[-1])
        dequantized = np.asarray(w_up.qvalue, np.float32) * np.asarray(w_up.scale)
        assert abs(dequantized.std() / bench.WEIGHT_STD - 1) < 0.05  # the float weights' spread
    assert abs(np.asarray(got["embed"], np.float32).std() / bench.WEIGHT_STD - 1) < 0.05


def test_engine_serves_drawn_int8_weights_as_generate_does():
    bench = _bench()
    cfg = dataclasses.replace(tiny_model(), quant=quant.SCHEMES["w8a8"][1])  # float32: generate's exact tokens
    params = bench.random_params(cfg, VOCAB, "w8a8")
    engine = InferenceEngine(cfg, params, ByteTokenizer(), kv_pages=16, page_size=PAGE, max_seqs=2,
                             max_tokens_per_step=8)
    prompt = np.random.default_rng(3).integers(0, 256, 11)
    engine.add_request("r", prompt.tolist(), SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=()))
    tokens = []
    while engine.has_work():
        tokens += [e.token_id for e in engine.step() if e.token_id is not None]
    want = gen.generate(model_graphdef(cfg, VOCAB), params, jnp.asarray(prompt[None], jnp.int32), max_new_tokens=8,
                        vocab_limit=LIMIT)
    assert tokens == np.asarray(want)[0].tolist() and len(set(tokens)) > 1


def test_a_level_counts_its_tokens_and_splits_its_steps_into_host_and_device():
    """run_level's row: every request's output tokens, and each step's wall time split into the host's own (the
    "host" column) and its waits for the device's results (engine.waited_s), so a chip row shows which bounds it."""
    import argparse

    bench = _bench()
    cfg = tiny_model()
    engine = InferenceEngine(cfg, random_params(cfg)[1], ByteTokenizer(), kv_pages=16, page_size=PAGE, max_seqs=2,
                             max_tokens_per_step=8)
    waited = engine.waited_s
    row = bench.run_level(engine, VOCAB, 2, argparse.Namespace(prompt=5, output=4))
    assert row["output_tokens"] == 2 * 2 * 4 and row["steps"] > 4
    assert engine.waited_s > waited  # the engine read results it had to wait for
    assert 0 < row["host_ms"] < row["step_ms"]
