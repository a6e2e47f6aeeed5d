"""`systolic serve` as evaluation harnesses and load generators use it, with their own code unchanged:
lm-evaluation-harness (`simple_evaluate` with `local-completions`) scores a local multiple-choice task and a local
generation task, and guidellm loads the server with 16 concurrent streams of fixed output lengths. Both tokenize
with the run's tokenizer as Hugging Face loads it (data/hf_tokenizer.py), which the server names in /v1/models.

The model: a tiny random Llama (2 layers, 256 positions) on the byte tokenizer, imported with `systolic convert
from-hf` from a folder without a tokenizer.json, one server shared by every test here. No download: the tasks are
local YAML and JSONL files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from systolic.cli import main
from systolic.data.tokenizer import ByteTokenizer
from systolic.workloads.lm import evaluate
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.hf import convert as hf
from systolic.workloads.lm.model.config import ModelConfig

from serve_process import running


# Exactly the byte tokenizer's ids: `eval lm` normalizes over every embedding row, the server over the tokenizer's.
VOCAB = 258
MODEL = ModelConfig(d_model=64, layers=2, heads=4, kv_heads=2, max_seq_len=256, vocab_size=VOCAB)
SETTINGS = {"max_seqs": 16, "max_queue": 64, "max_tokens_per_step": 64}
ITEMS = [  # choices carry their leading space: the task's target_delimiter is "" as `eval lm` reads items
    {"context": "The capital of France is", "choices": [" Paris", " London", " a potato"], "label": 0},
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " a - b"], "label": 1},
    {"context": "Zürich liegt in der", "choices": [" Schweiz", " Österreich", " Bayern"], "label": 0},
    {"context": "One, two, three,", "choices": [" four", " five", " many"], "label": 0},
    {"context": "x" * 40 + " and then", "choices": [" yes", " no way at all"], "label": 1},
]
PROMPTS = ["Once upon a time", "The quick brown fox", "def fib(n):", "Zürich liegt"]
STOP = "\n\n"
GEN_TOKENS = 12


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clients-model")
    folder = root / "hf"
    folder.mkdir()
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(0, 0.2, x.shape).astype(np.float32), hf.abstract_params(MODEL, VOCAB))
    hf.write_safetensors(folder, hf.export_tensors(MODEL, params), 1 << 30)
    (folder / "config.json").write_text(json.dumps(hf_config.hf_config(MODEL, VOCAB, {})))
    assert main(["convert", "from-hf", str(folder), str(root / "run")]) == 0  # no tokenizer.json: bytes
    return root / "run"


@pytest.fixture(scope="module")
def served(run_dir, tmp_path_factory):
    """The server and its model card: the model's name and the tokenizer folder ("root") that clients are given."""
    with running(run_dir, tmp_path_factory.mktemp("log") / "server.log", **SETTINGS) as s:
        yield s, s.get("/v1/models").json()["data"][0]


def test_echo_logprobs_equal_eval_lms_per_token_logprobs(served, run_dir):
    srv, card = served
    text = "The capital of France is Paris."
    reply = srv.post("/v1/completions", {"model": card["id"], "prompt": text, "echo": True, "logprobs": 3,
                                         "max_tokens": 0}).json()
    choice = reply["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 0
    ids = ByteTokenizer().encode(text).astype(np.int32)
    want = evaluate.token_logprobs(evaluate.load_run(run_dir, evaluate.COMMAND), ids)  # (P - 1,)
    got = choice["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    np.testing.assert_allclose(got[1:], want, atol=1e-4)
    tops = choice["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(t) <= 3 and max(t.values()) >= lp - 1e-6 for t, lp in zip(tops[1:], got[1:]))

    # With a completion after it: the same prompt scores, then the greedy tokens with their alternatives.
    more = srv.post("/v1/completions", {"model": card["id"], "prompt": list(map(int, ids)), "echo": True,
                                        "logprobs": 1, "max_tokens": 4, "temperature": 0}).json()["choices"][0]
    np.testing.assert_allclose(more["logprobs"]["token_logprobs"][1:len(ids)], want, atol=1e-4)
    generated = more["logprobs"]["token_logprobs"][len(ids):]
    assert len(generated) == 4 and more["text"].startswith(text)
    assert all(abs(max(t.values()) - lp) < 1e-5 for t, lp in zip(more["logprobs"]["top_logprobs"][len(ids):],
                                                                   generated))  # greedy: the top one is the chosen


def test_lm_evaluation_harness_scores_as_eval_lm_and_generates_as_generate(served, run_dir, tmp_path, monkeypatch,
                                                                           capsys):
    srv, card = served
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    items, prompts = tmp_path / "items.jsonl", tmp_path / "prompts.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    prompts.write_text("".join(json.dumps({"prompt": p, "target": ""}) + "\n" for p in PROMPTS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(
        f"task: systolic_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {items}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    (tasks / "gen.yaml").write_text(
        f"task: systolic_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {prompts}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        f"generation_kwargs:\n  until: [{json.dumps(STOP)}]\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")
    model_args = (f"model={card['id']},base_url={srv.url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={card['root']},tokenized_requests=True,max_length=256,num_concurrent=4")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                      tasks=["systolic_mc", "systolic_gen"], task_manager=TaskManager(
                                          include_path=str(tasks), include_defaults=False), log_samples=True)

    # Multiple choice: the same choice per item as `systolic eval lm --choices`, so the same accuracy.
    run = evaluate.load_run(run_dir, evaluate.COMMAND, sharded=True)
    want = evaluate.score_choices(run, evaluate.read_choices(items), rows=8)
    samples = sorted(results["samples"]["systolic_mc"], key=lambda s: s["doc_id"])
    got = [np.array([r[0] for r in s["filtered_resps"]], float) for s in samples]
    assert [int(np.argmax(g)) for g in got] == [int(np.argmax(w)) for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-3)
    accuracy = results["results"]["systolic_mc"]["acc,none"]
    assert accuracy == evaluate.accuracies(evaluate.read_choices(items), want)["acc"]

    # Generation: `systolic generate`'s greedy continuations, cut at the task's stop string.
    answers = [s["filtered_resps"][0] for s in sorted(results["samples"]["systolic_gen"], key=lambda s: s["doc_id"])]
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        capsys.readouterr()
        assert main(["generate", str(run_dir), "--prompt", prompt, "--max-new-tokens", str(GEN_TOKENS),
                     "--temperature", "0"]) == 0
        generated = capsys.readouterr().out.rstrip("\n")[len(prompt):]
        assert answer == generated.split(STOP)[0], prompt


def test_guidellm_at_16_streams_of_fixed_length(served, tmp_path):
    srv, card = served
    pytest.importorskip("guidellm")
    lengths = [8, 16, 24, 32]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{PROMPTS[i % 4]} {i}", "output_tokens_count": lengths[i % 4]})
                            + "\n" for i in range(64)))
    report = tmp_path / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "ERROR"}
    command = [str(Path(sys.executable).with_name("guidellm")), "run",
               "--backend", f"kind=openai_http,target={srv.url},model={card['id']},request_format=/v1/completions",
               "--profile", "kind=concurrent,streams=16", "--constraint", "kind=max_requests,count=64",
               "--constraint", "kind=max_duration,seconds=300",
               "--tokenizer", f"kind=huggingface_auto,model={card['root']}",
               "--data", f"kind=json_file,path={data}", "--output", f"kind=json,path={report}",
               "--disable-console-interactive"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    requests = benchmark["requests"]
    assert not requests["errored"] and not requests["incomplete"] and len(requests["successful"]) == 64
    for request in requests["successful"]:
        asked = json.loads(request["request_args"])["body"]["max_tokens"]
        assert request["output_metrics"]["text_tokens"] == asked
    assert sorted({json.loads(r["request_args"])["body"]["max_tokens"] for r in requests["successful"]}) == lengths
