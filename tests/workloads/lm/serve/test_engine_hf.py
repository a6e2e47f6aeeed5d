"""The engine of an imported run against transformers itself: a tiny random Llama (grouped-query attention, a
non-default RoPE theta) imported with `convert from-hf`, opened by `InferenceEngine.from_run`, answers requests
arriving at different steps with transformers' greedy tokens; split over a tensor=2 mesh too."""

import collections

import numpy as np
import pytest

from tiny_hf import make_hf_model
from tiny_serve import drive, token_ids

from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

NEW = 10
LIMIT = 258  # the run has no tokenizer.json, so it uses bytes: the engine samples from the byte tokenizer's ids
PROMPTS = np.random.default_rng(0).integers(0, 256, (4, 12))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(transformers model, the imported run directory)."""
    root = tmp_path_factory.mktemp("serve-hf")
    model = make_hf_model("llama")
    model.save_pretrained(root / "hf")
    hf.import_run(root / "hf", root / "run")
    return model, root / "run"


def transformers_greedy(model, prompt: np.ndarray) -> list[int]:
    seq = prompt.tolist()
    with torch.no_grad():
        for _ in range(NEW):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1, :LIMIT].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("tensor", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_imported_llama_matches_transformers(llama, tensor):
    model, run = llama
    said = []
    engine = InferenceEngine.from_run(run, kv_memory_gib=0.001, page_size=4, max_seqs=4, max_tokens_per_step=8,
                                      mesh_tensor=tensor, say=said.append)
    assert said[0].startswith("KV cache: ") and "--kv-memory-gib 0.001" in said[0]
    assert engine.model_name == "run" and engine.max_context == 64 and engine.chat_template is None
    arrivals = collections.defaultdict(list)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=())
    for i, step in enumerate((0, 1, 1, 4)):
        arrivals[step].append((f"r{i}", PROMPTS[i].tolist(), params))
    events = drive(engine, arrivals)
    for i, prompt in enumerate(PROMPTS):
        want = transformers_greedy(model, prompt)
        assert token_ids(events[f"r{i}"]) == want
    assert len({t for i in range(4) for t in token_ids(events[f"r{i}"])}) > 5
