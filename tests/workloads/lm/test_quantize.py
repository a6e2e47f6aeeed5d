"""Quantized weights and matmuls (lm/model/quant.py, through Qwix): the projections against float64 NumPy
references of per-channel / per-row absmax quantization, an imported Llama's int8 logits against its float ones,
`systolic quantize` written and read back, quantized serving on a tensor mesh equal to one device, and the
perplexity a trained run loses to int8 weights."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiny import LM_CLI_QUIET, TINY_LM
from tiny_hf import make_hf_model
from tiny_serve import random_params, tiny_model

from systolic import cli
from systolic.data.tokenizer import ByteTokenizer
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.model import quant
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams
from systolic.workloads.lm.serve.sizing import tensor_layout

_rng = np.random.default_rng(0)
X = _rng.normal(size=(2, 5, 4, 8)).astype(np.float32)  # (B, T, H, hd): contracted over its last 2 axes by wo
W = _rng.normal(size=(4, 8, 16)).astype(np.float32)  # (H, hd, D), as Attention.wo
# Each slice's largest magnitude positive: a negative one sits at -127.5 steps, a tie that float32 rounding
# sends to -128 or -127 (and +127.5 clips to 127 either way).
X[:, :, 0, 0] = np.abs(X).max(axis=(2, 3)) + 0.1
W[0, 0, :] = np.abs(W).max(axis=(0, 1)) + 0.1


def fake_quant(a: np.ndarray, reduce: tuple[int, ...]) -> np.ndarray:
    """Symmetric absmax int8 quantization of `a` in float64, one scale per slice over the axes not in `reduce`,
    dequantized: what an int8 value times its scale stands for. Qwix's convention: the scale maps absmax to 127.5,
    so all 256 int8 values are used (rounded, then clipped to [-128, 127])."""
    a = a.astype(np.float64)
    scale = np.abs(a).max(axis=reduce, keepdims=True) / 127.5
    return np.clip(np.round(a / scale), -128, 127) * scale


def test_int8_weights_are_their_per_channel_rounding_and_the_projection_uses_them():
    q = quant.quantize_params({"wo": W}, "int8", stacked=False)["wo"]
    assert q.qvalue.dtype == jnp.int8 and q.scale.shape == (1, 1, 16)  # one scale per output channel
    want = np.einsum("bthk,hkd->btd", X.astype(np.float64), fake_quant(W, (0, 1)))
    got = quant.project(jnp.asarray(X), q, contract=2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Not the float product: the test would pass without quantization otherwise.
    assert np.abs(want - np.einsum("bthk,hkd->btd", X, W)).max() > 1e-3


def test_w8a8_quantizes_each_row_of_activations_too():
    q = quant.quantize_params({"wo": W}, "w8a8", stacked=False)["wo"]
    want = np.einsum("bthk,hkd->btd", fake_quant(X, (2, 3)), fake_quant(W, (0, 1)))  # a scale per token
    got = quant.project(jnp.asarray(X), q, contract=2, quant="int8")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - quant.project(jnp.asarray(X), q, contract=2)).max() > 1e-4  # the activations did change


def test_the_command_line_offers_every_scheme():
    from systolic.workloads.lm.commands import QUANTIZE_SCHEMES  # the CLI's module stays light: its own tuple

    assert QUANTIZE_SCHEMES == tuple(quant.SCHEMES)


def test_stacked_layers_keep_a_scale_per_layer_and_other_weights_stay_float():
    cfg = tiny_model("model.scan_layers=true")
    _, params = random_params(cfg)
    qp = quant.quantize_params(params, "int8", stacked=True)
    wq = qp["blocks"]["attn"]["wq"]  # (L, D, H, hd)
    assert wq.scale.shape == (cfg.layers, 1, cfg.heads, cfg.d_head)
    assert qp["embed"] is params["embed"] and qp["blocks"]["attn_norm"]["scale"] is params["blocks"]["attn_norm"]["scale"]
    assert quant.param_bytes(qp) < 0.5 * quant.param_bytes(params)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-hf")
    make_hf_model("llama").save_pretrained(root / "hf")
    assert cli.main(["convert", "from-hf", str(root / "hf"), str(root / "run")]) == 0
    return root / "run"


def test_int8_logits_of_an_imported_llama_stay_close_to_float(imported):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 258, (2, 24)), jnp.int32)
    logits = {}
    for scheme in (None, "int8", "w8a8"):
        run = load_run(imported, "test", quantize=scheme)
        logits[scheme] = np.asarray(jax.jit(lambda p, t, g=run.graphdef: nnx.merge(g, p)(t))(run.params, tokens))
    scale = np.abs(logits[None]).max()
    # The stated tolerances, as fractions of the largest float logit: (max, mean) of |quantized - float|. Measured
    # on this random model (std 0.2 weights, sharp logits): int8 0.039 / 0.0061, w8a8 0.081 / 0.0093; greedy
    # agreement 97.9% for both.
    for scheme, (worst, mean) in {"int8": (0.05, 0.01), "w8a8": (0.10, 0.015)}.items():
        err = np.abs(logits[scheme] - logits[None]) / scale
        assert 1e-5 < err.max() < worst and err.mean() < mean, (scheme, err.max(), err.mean())
        agree = (logits[scheme].argmax(-1) == logits[None].argmax(-1)).mean()
        assert agree >= 0.95, (scheme, agree)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir):
    root = tmp_path_factory.mktemp("quant-run")
    assert cli.main(["train", "lm", *TINY_LM, *LM_CLI_QUIET, f"data.path={corpus_dir}", "--run-dir",
                     str(root / "run")]) == 0
    return root


def _eval(capsys, *args) -> dict:
    capsys.readouterr()
    assert cli.main(["eval", "lm", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_quantize_writes_a_run_that_loads_without_the_float_one(trained, corpus_dir, capsys):
    run, out = trained / "run", trained / "int8"
    assert cli.main(["quantize", str(run), "--scheme", "int8", "--out", str(out)]) == 0
    saved, live = load_run(out, "test"), load_run(run, "test", quantize="int8")
    assert saved.quantized == live.quantized == "int8" and saved.step == live.step
    for a, b in zip(jax.tree.leaves(saved.params), jax.tree.leaves(live.params), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert saved.params["blocks"][0]["attn"]["wq"].qvalue.dtype == jnp.int8
    # Held-out perplexity: int8 weights cost under 2% (acceptance of the quantization issue).
    float_ppl = _eval(capsys, run, "--data", corpus_dir)["perplexity"]
    for args in ((out,), (run, "--quantize", "w8a8")):
        ppl = _eval(capsys, *args, "--data", corpus_dir)["perplexity"]
        assert ppl != float_ppl and abs(ppl / float_ppl - 1) < 0.02, (args, ppl, float_ppl)


@pytest.mark.parametrize("argv, says", [
    (["quantize", "{q}", "--scheme", "int8", "--out", "{root}/again"], "already quantized"),
    (["quantize", "{run}", "--scheme", "int8", "--out", "{q}"], "already exists"),
    (["export", "{q}", "--out", "{root}/m.jaxexport"], "needs float weights"),
    (["generate", "{q}", "--quantize", "fp8", "--prompt", "x"], "already quantized"),
], ids=["twice", "existing-out", "export", "generate-requantize"])
def test_quantized_runs_are_refused_where_float_weights_are_needed(trained, argv, says, capsys):
    q = trained / "q"
    if not q.exists():
        assert cli.main(["quantize", str(trained / "run"), "--scheme", "int8", "--out", str(q)]) == 0
    capsys.readouterr()
    argv = [a.format(q=q, run=trained / "run", root=trained) for a in argv]
    assert cli.main(argv) == 2
    assert says in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("scheme, kv_cache", [("int8", "auto"), ("w8a8", "int8")])
def test_quantized_engine_on_a_tensor_mesh_matches_one_device(scheme, kv_cache):
    cfg = tiny_model()
    qcfg = dataclasses.replace(cfg, quant=quant.SCHEMES[scheme][1])
    params = quant.quantize_params(random_params(cfg)[1], scheme, stacked=False)
    prompt = np.random.default_rng(2).integers(0, 256, 11).tolist()
    outs = []
    for layout in (None, tensor_layout(qcfg, 4)):
        mesh, rules = layout or (None, None)
        engine = InferenceEngine(qcfg, params, ByteTokenizer(), kv_pages=16, page_size=4, max_seqs=2,
                                 max_tokens_per_step=8, mesh=mesh, rules=rules, kv_cache=kv_cache)
        engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=()))
        tokens = []
        while engine.has_work():
            tokens += [e.token_id for e in engine.step()]
        outs.append(tokens)
    wq = engine.params["blocks"][0]["attn"]["wq"]
    assert wq.qvalue.sharding.spec[1] == "tensor" and wq.qvalue.dtype == jnp.int8
    assert outs[0] == outs[1] and len(set(outs[0])) > 1
