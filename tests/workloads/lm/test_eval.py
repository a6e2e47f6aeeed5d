"""`systolic eval lm` against transformers itself: a tiny random Llama, imported with `systolic convert from-hf`,
scores multiple-choice continuations and text the way a direct computation with the transformers model on the same
token ids does; the figures are the same on 1 device and on 8 sharded ones; bad input is one paragraph, exit 2."""

import json
import shutil

import jax
import numpy as np
import pytest
import yaml

from systolic import cli
from systolic.data.tokenizer import ByteTokenizer
from systolic.workloads.lm import evaluate
from systolic.workloads.lm.loaded_run import load_run
from tiny_hf import make_hf_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EOT = ByteTokenizer.eot_id
MAX_LEN = 64  # the tiny model's max_position_embeddings: model.max_seq_len and (imported) data.seq_len
# Written by hand: an empty context (scored after the end-of-text id), a context ending in spaces (they move to the
# continuation), multi-byte characters (acc_norm counts characters, not bytes) and one too long for the model (the
# context loses its oldest bytes, the continuation stays whole).
ITEMS = [
    {"context": "The capital of France is", "choices": [" Paris", " London", " a potato"], "label": 0},
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " a - b"], "label": 1},
    {"context": "", "choices": ["hello", "goodbye, world"], "label": 1},
    {"context": "Zürich liegt in der ", "choices": ["Schweiz", "Österreich", "Bayern"], "label": 0},
    {"context": "x" * 90 + " and then  ", "choices": ["yes", "no way at all"], "label": 1},
]
TEXT = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 9, "Grüße aus Zürich. " * 20]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(the transformers model, its import: a run directory with the byte tokenizer)."""
    root = tmp_path_factory.mktemp("eval")
    model = make_hf_model("llama")
    model.save_pretrained(root / "hf")
    assert cli.main(["convert", "from-hf", str(root / "hf"), str(root / "run")]) == 0
    return model, root / "run"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-files")
    (root / "items.jsonl").write_text("\n".join(json.dumps(item) for item in ITEMS) + "\n\n", encoding="utf-8")
    (root / "text").mkdir()
    for i, text in enumerate(TEXT):
        (root / "text" / f"{i}.txt").write_text(text, encoding="utf-8")
    return root


def hf_loglikelihoods(model, ids: list[int]) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t >= 1, from transformers, float64 (len(ids) - 1,)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0].double()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def reference_choices(model) -> tuple[list[np.ndarray], float, float]:
    """Per item, each continuation's summed log-likelihood computed directly: bytes end to end (trailing spaces of
    the context moved over, an empty context as the end-of-text id), cut on the left to MAX_LEN inputs."""
    lls = []
    for item in ITEMS:
        context = item["context"].rstrip()
        moved = item["context"][len(context):]
        row = []
        for choice in item["choices"]:
            head = list(context.encode()) if context else [EOT]
            tail = list((moved + choice).encode())
            ids = (head + tail)[-(MAX_LEN + 1):]
            row.append(hf_loglikelihoods(model, ids)[-len(tail):].sum())
        lls.append(np.array(row))
    acc = np.mean([np.argmax(ll) == item["label"] for ll, item in zip(lls, ITEMS)])
    norm = np.mean([np.argmax(ll / [len(c) for c in item["choices"]]) == item["label"] for ll, item in zip(lls, ITEMS)])
    return lls, float(acc), float(norm)


def reference_text(model) -> tuple[int, float]:
    """(targets, mean cross-entropy in nats) over non-overlapping windows of MAX_LEN targets of the documents as
    training reads them (each followed by the end-of-text id), after one end-of-text id."""
    ids = [EOT] + [i for text in TEXT for i in [*text.encode(), EOT]]
    nats = -sum(hf_loglikelihoods(model, ids[start : start + MAX_LEN + 1]).sum()
                for start in range(0, len(ids) - 1, MAX_LEN))
    return len(ids) - 1, nats / (len(ids) - 1)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_choices_match_transformers(llama, files, capsys):
    model, run_dir = llama
    want, acc, acc_norm = reference_choices(model)
    run = load_run(run_dir, "test", sharded=True)
    items = evaluate.read_choices(files / "items.jsonl")
    got = evaluate.score_choices(run, items, rows=8)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)
    with capsys.disabled():
        print(f"choices: summed log-likelihoods max-abs-diff {max(np.abs(g - w).max() for g, w in zip(got, want)):.2e}")
    assert len({int(np.argmax(ll)) for ll in want}) > 1  # the random model does not always pick the same index

    assert cli.main(["eval", "lm", str(run_dir), "--choices", str(files / "items.jsonl"), "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    figures = last_json(out)
    assert figures["items"] == len(ITEMS) and figures["continuations"] == 12 and figures["checkpoint_step"] == 0
    assert figures["acc"] == pytest.approx(acc) and figures["acc_norm"] == pytest.approx(acc_norm)
    assert "acc_norm" in out and "mesh data=8 x fsdp=1 x tensor=1 (the run's" in out


def test_text_matches_transformers(llama, files, capsys):
    model, run_dir = llama
    tokens, nats_per_token = reference_text(model)
    assert cli.main(["eval", "lm", str(run_dir), "--data", str(files / "text"), "--batch-size", "2"]) == 0
    figures = last_json(capsys.readouterr().out)
    text_bytes = sum(len(t.encode()) for t in TEXT)
    assert (figures["tokens"], figures["bytes"]) == (tokens, text_bytes)
    with capsys.disabled():
        print(f"text: {tokens} tokens, nats/token {figures['nats_per_token']:.7f}, transformers {nats_per_token:.7f}")
    assert figures["nats_per_token"] == pytest.approx(nats_per_token, rel=1e-5)
    assert figures["nats_per_byte"] == pytest.approx(nats_per_token * tokens / text_bytes, rel=1e-5)
    assert figures["bits_per_byte"] == pytest.approx(figures["nats_per_byte"] / np.log(2))
    assert figures["perplexity"] == pytest.approx(np.exp(nats_per_token), rel=1e-5)


def test_same_figures_on_one_device_and_a_sharded_mesh(llama, files, tmp_path):
    """The run's mesh (fsdp=4 x tensor=2) on 8 devices, with each parameter split; on 1 device it does not fit, so
    the parameters sit whole on it."""
    run_dir = tmp_path / "run"
    shutil.copytree(llama[1], run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["mesh"] = {"data": 1, "fsdp": 4, "tensor": 2}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    docs = evaluate.read_text(str(files / "text"))
    items = evaluate.read_choices(files / "items.jsonl")
    results = []
    for devices in (jax.devices()[:1], jax.devices()):
        run = load_run(run_dir, "test", sharded=True, devices=devices)
        rows = evaluate.batch_rows(run, 3)
        results.append((evaluate.score_text(run, docs, rows=rows), evaluate.score_choices(run, items, rows=rows)))
        if len(devices) == 8:
            assert dict(run.mesh.shape) == {"data": 1, "stage": 1, "fsdp": 4, "expert": 1, "context": 1,
                                            "tensor": 2} and rows == 4
            embed = run.params["embed"]  # (vocab, d_model): vocab over tensor, d_model over fsdp
            assert embed.addressable_shards[0].data.shape == (embed.shape[0] // 2, embed.shape[1] // 4)
        else:
            assert "does not fit these 1 device(s)" in run.layout and rows == 3
    (text_1, choices_1), (text_8, choices_8) = results
    assert text_1.tokens == text_8.tokens and text_8.nats == pytest.approx(text_1.nats, rel=1e-5)
    for a, b in zip(choices_1, choices_8, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_text_windows_score_every_token_once():
    ids = np.arange(1, 38)  # 36 targets: two full windows of 16, then 4 in a padded one
    batches, count = evaluate.text_batches(ids, 16, rows=2)
    batches = list(batches)
    assert count == len(batches) == 2
    targets = np.concatenate([b["targets"][b["mask"]] for b in batches])
    np.testing.assert_array_equal(targets, ids[1:])
    for b in batches:  # each target follows its input, as in training's windows
        np.testing.assert_array_equal(b["targets"][:, :-1][b["mask"][:, 1:]], b["inputs"][:, 1:][b["mask"][:, 1:]])
    assert batches[1]["mask"][0].sum() == 4 and not batches[1]["mask"][1].any()


def test_pairs_follow_lm_evaluation_harness():
    tok = ByteTokenizer()
    context, continuation = evaluate.encode_pair(tok, "a b  ", "c")
    assert context.tolist() == [97, 32, 98] and continuation.tolist() == [32, 32, 99]
    context, continuation = evaluate.encode_pair(tok, "", "hi")
    assert context.tolist() == [EOT] and continuation.tolist() == [104, 105]
    assert [evaluate.bucket_length(n, 64) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


@pytest.mark.parametrize("args, fragments", [
    (["--data", "/no/such/file.txt"], ["--data /no/such/file.txt: no such file or folder"]),
    (["--choices", "/no/such/items.jsonl"], ["no such file"]),
    (["--choices", "{bad}"], ["line 2: not valid JSON"]),
    (["--choices", '{"context": "a", "choices": ["b", "c"], "label": 2}'], ["line 2", '"label" is 2', "0 to 1"]),
    (["--choices", '{"context": "a", "choices": ["b", "c"], "gold": 0}'], ["line 2", 'rename it to "label"']),
    (["--choices", '{"context": "a", "choices": ["b"], "label": 0}'], ["line 2", "two or more"]),
    (["--data", "x.txt", "--choices", "y.jsonl"], ["exactly one of --data FILE and --choices", "got both"]),
    ([], ["exactly one of --data FILE and --choices", "got neither"]),
    (["--data", "x.txt", "--episodes", "3"], ["has no option --episodes", "option of `systolic eval rl`"]),
    (["--data", "x.txt", "--batch-size", "0"], ["--batch-size 0 must be at least 1"]),
])
def test_bad_input_is_one_paragraph_exit_2(llama, tmp_path, capsys, args, fragments):
    if args[:1] == ["--choices"] and args[1].startswith("{"):  # a file whose second line is this
        (tmp_path / "items.jsonl").write_text(json.dumps(ITEMS[0]) + "\n" + args[1] + "\n", encoding="utf-8")
        args = ["--choices", str(tmp_path / "items.jsonl")]
    assert cli.main(["eval", "lm", str(llama[1]), *args]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert err.startswith("error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in " ".join(err.split()), err

