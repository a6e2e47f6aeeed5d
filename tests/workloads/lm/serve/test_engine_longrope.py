"""LongRoPE (Phi-3) through the inference engine against transformers: a tiny random Phi-3 (float32, eager) with an
original context of 16, imported with `convert from-hf` and served. Sequences that cross the original context while
they decode (recomputed with the long factors, as transformers' `generate` recomputes its cache), prompts longer
than it (long from the start, also when their prefill is chunked), and prefixes cached by earlier requests of the
other regime give transformers' greedy tokens and systolic `generate`'s, and samples keep their random stream."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny_serve import drive, token_ids

from systolic.workloads.lm.model import decode as gen
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams
from systolic.workloads.lm.model.build import model_graphdef

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 320
LIMIT = 258  # the run has no tokenizer.json, so it uses bytes: the engine samples from the byte tokenizer's ids
ORIGINAL = 16  # original_max_position_embeddings: past it LongRoPE rotates by its long factors
NEW = 16
rng = np.random.default_rng(3)
SHORT = rng.integers(0, 256, 10).tolist()  # 10 + 16 new tokens: crosses the original context at its 7th new token
LONG = rng.integers(0, 256, 20).tolist()  # longer than the original context: long factors from the start
# Requests after the first ones end (their lengths the others', for `generate`'s compiled programs): a long prompt
# whose first pages the first request computed twice (short, then long once it crossed), and a short one that shares
# its first 8 tokens with the first request's short-rotated pages.
LATE_LONG = SHORT + rng.integers(0, 256, 10).tolist()
LATE_SHORT = SHORT[:8] + rng.integers(0, 256, 2).tolist()
PROMPTS = {"short": SHORT, "long": LONG, "late-long": LATE_LONG, "late-short": LATE_SHORT}  # greedy requests
SEED = 11


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(transformers model, the imported run directory)."""
    root = tmp_path_factory.mktemp("serve-longrope")
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=ORIGINAL,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager",
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                      "long_factor": [1.5 + 0.7 * i for i in range(8)]})
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config)
    with torch.no_grad():  # std 0.2: logits far from uniform, so argmax has no near-ties
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    model.eval().save_pretrained(root / "hf")
    hf.import_run(root / "hf", root / "run")
    return model, root / "run"


def transformers_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' Phi-3 `generate` (which recomputes its cache where the sequence crosses the original context),
    greedy among the byte tokenizer's ids; its end-of-text id is an ordinary token here, as in the engine's
    requests."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None,
                             suppress_tokens=list(range(LIMIT, VOCAB)))
    return out[0, len(prompt):].tolist()


def systolic_generate(run_dir, prompt: list[int], **sampling) -> list[int]:
    run = load_run(run_dir, "test")
    graphdef = model_graphdef(dataclasses.replace(run.cfg.model, dtype="float32"), VOCAB)
    out = gen.generate(graphdef, run.params, jnp.asarray([prompt], jnp.int32), max_new_tokens=NEW, vocab_limit=LIMIT,
                       **sampling)
    return np.asarray(out)[0].tolist()


@pytest.fixture(scope="module")
def references(phi3):
    """request name -> its tokens: transformers' greedy ones, which systolic `generate` gives too, and `generate`'s
    samples of SEED."""
    model, run = phi3
    want = {name: transformers_greedy(model, prompt) for name, prompt in PROMPTS.items()}
    for name, prompt in PROMPTS.items():
        assert systolic_generate(run, prompt) == want[name], name
    want["sampled"] = systolic_generate(run, SHORT, temperature=1.0, key=jax.random.PRNGKey(SEED))
    return want


@pytest.mark.parametrize("max_tokens_per_step, prefix_caching", [
    pytest.param(8, True, id="chunked"),
    pytest.param(32, False, id="whole", marks=pytest.mark.slow),  # the suite's time: one setting in `make test`
])
def test_sequences_across_the_original_context_match_transformers(phi3, references, max_tokens_per_step,
                                                                   prefix_caching):
    _, run = phi3
    engine = InferenceEngine.from_run(run, kv_memory_gib=0.001, page_size=4, max_seqs=4,
                                      max_tokens_per_step=max_tokens_per_step, prefix_caching=prefix_caching,
                                      say=lambda _: None)
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=())
    sampled = SamplingParams(max_tokens=NEW, temperature=1.0, seed=SEED, stop_token_ids=())
    arrivals = {0: [("short", SHORT, greedy), ("sampled", SHORT, sampled)], 1: [("long", LONG, greedy)],
                60: [("late-long", LATE_LONG, greedy), ("late-short", LATE_SHORT, greedy)]}
    events = drive(engine, arrivals)
    assert events["short"][-1].finish_reason == "length"  # done before the late requests arrive
    for name, want in references.items():
        assert token_ids(events[name]) == want, name
    # Chunked, "sampled" starts a step after "short": it finds short's first 8 prompt tokens (short-rotated), and
    # where it crosses the original context, 16 of its 17 tokens long-rotated by short's recomputation a step before.
    # The late requests find 8 tokens each of their own regime: LATE_LONG long-rotated, LATE_SHORT short-rotated.
    assert engine.stats()["prefix_hit_tokens"] == (8 + 16 + 8 + 8 if prefix_caching else 0)
    assert engine.stats()["preemptions"] == 0
