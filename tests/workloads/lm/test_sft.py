"""Supervised fine-tuning (`systolic train lm --recipe sft`, data.format=chat): the loss mask is exactly the assistant's
tokens, whole examples are packed into rows that never attend across examples, micro-batches weigh by their
assistant tokens, a fine-tune of an imported tiny Llama lowers the held-out loss and resumes bit for bit, and bad
inputs are one-paragraph errors. The tokenizer is a byte-level BPE trained here with the `tokenizers` library and
saved with a ChatML template as a Hugging Face folder has them: no download."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tokenizers import Tokenizer

from tiny import TINY_LM, call
from tiny_hf import CAPITALS, CHATML, CONVERSATION, chats, make_hf_model, save_chat_tokenizer

from systolic.data import packed, sft
from systolic.data.tokenizer import ByteTokenizer, make_tokenizer
from systolic.data.chat import find_chat_template
from systolic.engine.state import TrainState
from systolic.engine.step import make_train_step
from systolic.errors import UserError

def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return save_chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def learnt_runs(rows: packed.PackedRows, decode) -> list[str]:
    """The text of each run of consecutive targets in the loss, row by row, with the special tokens spelt out."""
    batch = rows.batch(np.arange(len(rows)))
    runs = []
    for targets, mask in zip(batch["targets"], batch["loss_mask"]):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))  # starts and ends of the masked runs
        runs += [decode(targets[start:end]) for start, end in zip(edges[::2], edges[1::2])]
    return runs


# THE LOSS MASK ------------------------------------------------------------------------------------------------


def test_the_loss_is_on_the_assistant_turns_and_completions_only(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "two.jsonl", [{"messages": CONVERSATION},
                                                {"prompt": "The capital of Spain is", "completion": " Madrid."}])
    data = sft.load_chat_corpus(str(path), make_tokenizer(str(tokenizer_dir)), seq_len=128, val_percent=50)
    assert data.examples == (1, 1) and data.truncated == data.skipped == 0
    raw = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    decode = lambda ids: raw.decode(ids.tolist(), skip_special_tokens=False)  # noqa: E731
    runs = sorted(learnt_runs(data.train, decode) + learnt_runs(data.val, decode))
    # Each assistant message through its end-of-turn token (not the newline after it); the completion through the
    # end-of-document id that follows it.
    assert runs == sorted(["Paris.<|im_end|>", "Berlin, I think.<|im_end|>", " Madrid.<|endoftext|>"])
    assert sum(data.learn_tokens) == sum(int(rows.batch(np.arange(len(rows)))["loss_mask"].sum())
                                         for rows in (data.train, data.val))
    # Nothing else is learnt: prompts, headers, system and user text, padding.
    for rows in (data.train, data.val):
        batch = rows.batch(np.arange(len(rows)))
        rest = decode(batch["targets"][batch["loss_mask"] == 0])
        assert "Paris" not in rest and "Madrid" not in rest and "Berlin" not in rest
    assert "capital of France" in decode(data.train.tokens[0]) + decode(data.val.tokens[0])


def test_prompt_completion_is_plain_text_with_the_byte_tokenizer(tmp_path):
    records = [{"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "3 + 3 =", "completion": " 6"}]
    data = sft.load_chat_corpus(str(write_jsonl(tmp_path / "sums.jsonl", records)), ByteTokenizer(), seq_len=32,
                                val_percent=50)
    decode = lambda ids: "".join(chr(i) if i < 256 else f"<{i}>" for i in ids.tolist())  # noqa: E731
    runs = sorted(learnt_runs(data.train, decode) + learnt_runs(data.val, decode))
    assert runs == [" 4<256>", " 6<256>"]  # the completion and the end-of-document id, never the prompt
    assert decode(data.train.tokens[0]).startswith(("2 + 2 = 4<256>", "3 + 3 = 6<256>"))


# PACKING ------------------------------------------------------------------------------------------------------


def random_examples(n: int, row_len: int, seed: int = 0) -> list[packed.Example]:
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        size = int(rng.integers(1, row_len + 1)) if i % 7 else row_len  # some fill a row alone
        ids = rng.integers(3, 50, size).astype(np.uint16)
        ids[0] = 100 + i  # each example's first token names it
        examples.append((ids, rng.random(size) < 0.5))
    return examples


def test_rows_hold_whole_examples_with_their_own_segments_and_positions():
    row_len, examples = 17, random_examples(60, 17)
    rows = packed.pack(examples, row_len, pad_id=1, dtype=np.uint16)
    again = packed.pack(examples, row_len, pad_id=1, dtype=np.uint16)
    assert repr(rows) == repr(again), "packing is deterministic"
    sizes = sum(len(ids) for ids, _ in examples)
    assert len(rows) * row_len - sizes < row_len * 3, f"{len(rows)} rows for {sizes} tokens: too much padding"

    batch = rows.batch(np.arange(len(rows)))
    assert tuple(batch) == packed.BATCH_KEYS and all(v.dtype == np.int32 for v in batch.values())
    assert all(v.shape == (len(rows), row_len - 1) for v in batch.values())
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    seen = []
    for r in range(len(rows)):
        tokens, starts = rows.tokens[r], np.flatnonzero(rows.flags[r] & packed.START)
        ends = [*starts[1:], row_len]
        for start, end in zip(starts, ends):
            if tokens[start] < 100:  # the padding: pad ids, one segment, never learnt
                assert end == row_len and (tokens[start:] == 1).all()
                assert not (rows.flags[r, start:] & packed.LEARN).any()
                continue
            i = int(tokens[start]) - 100
            ids, learn = examples[i]
            seen.append(i)
            assert end - start == len(ids) and (tokens[start:end] == ids).all(), "an example is whole and contiguous"
            # Targets in the loss: the example's own tokens to learn except its first, whose target slot is the
            # previous example's last input.
            want = learn.copy()
            want[0] = False
            got = (rows.flags[r, start:end] & packed.LEARN) != 0
            np.testing.assert_array_equal(got, want)
            if start:
                assert batch["loss_mask"][r, start - 1] == 0
            inputs = slice(start, min(end, row_len - 1))  # the inputs this example owns
            if inputs.stop <= start:
                continue  # a one-token example in the row's last slot: a target only, never learnt
            assert (batch["positions"][r, inputs] == np.arange(inputs.stop - start)).all()
            assert len(set(batch["segment_ids"][r, inputs])) == 1
            others = np.ones(row_len - 1, bool)
            others[inputs] = False
            assert batch["segment_ids"][r, inputs][0] not in batch["segment_ids"][r, others]
    assert sorted(seen) == list(range(len(examples))), "every example once"


def test_eval_batches_take_every_row_and_pad_with_empty_rows():
    rows = packed.pack(random_examples(12, 9, seed=1), 9, pad_id=1, dtype=np.uint16)
    batches = packed.make_eval_batches(rows, batch=4, num_batches=8)
    assert len(batches) == -(-len(rows) // 4)
    inputs = np.concatenate([b["inputs"] for b in batches])
    masks = np.concatenate([b["loss_mask"] for b in batches])
    np.testing.assert_array_equal(inputs[: len(rows)], rows.tokens[:, :-1].astype(np.int32))
    assert (inputs[len(rows):] == 1).all() and not masks[len(rows):].any()
    assert masks.sum() == rows.batch(np.arange(len(rows)))["loss_mask"].sum()
    spread = packed.make_eval_batches(rows, batch=2, num_batches=1)  # fewer than all: evenly spread, first included
    np.testing.assert_array_equal(spread[0]["inputs"][0], rows.tokens[0, :-1])


# THE LOSS OVER MICRO-BATCHES ----------------------------------------------------------------------------------


def test_grad_accumulation_weighs_micro_batches_by_their_assistant_tokens():
    """A masked mean over a batch whose micro-batches hold 2 and 8 tokens to learn: accumulating with `loss_terms`
    gives the whole batch's update; equal weights would not."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5)), jnp.float32)
    mask = jnp.asarray([[1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [0, 1, 1, 1, 1]], jnp.int32)

    def loss_fn(params, batch, key):
        m = batch["loss_mask"].astype(jnp.float32)
        return ((batch["x"] - params["w"]) ** 2 * m).sum() / jnp.maximum(m.sum(), 1.0), {}

    def updated(accum, terms):
        tx = optax.sgd(1.0)
        params = {"w": jnp.zeros(5, jnp.float32)}
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                           rng=jax.random.PRNGKey(0))
        step = jax.jit(make_train_step(loss_fn, tx, grad_accum=accum, loss_terms=terms))
        new, metrics = step(state, {"x": x, "loss_mask": mask})  # micro-batches: rows 0, 2 and rows 1, 3
        return np.asarray(new.params["w"]), float(metrics["loss"])

    def terms(batch):
        return batch["loss_mask"].sum().astype(jnp.float32)

    whole, whole_loss = updated(1, None)
    weighted, weighted_loss = updated(2, terms)
    np.testing.assert_allclose(weighted, whole, rtol=1e-6, atol=1e-7)
    assert weighted_loss == pytest.approx(whole_loss, rel=1e-6)
    assert not np.allclose(updated(2, None)[0], whole, rtol=1e-3)


# A FINE-TUNE ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imported(tokenizer_dir, tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers with the ChatML tokenizer folder, imported as a run."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import shutil

    from systolic.workloads.lm.hf import convert as hf

    root = tmp_path_factory.mktemp("sft-model")
    make_hf_model("llama").save_pretrained(root / "hf")
    for path in tokenizer_dir.iterdir():
        shutil.copy(path, root / "hf" / path.name)
    hf.import_run(root / "hf", root / "run")
    return root / "run"


def sft_overrides(source: Path, data: Path) -> list[str]:
    """A 24-step fine-tune with the sft recipe: rows of 65 tokens (the model's 64 positions), a tiny model's rate."""
    return ["--recipe", "sft", f"init.from={source}", f"data.path={data}", "data.seq_len=64", "data.val_percent=10",
            "train.batch_size=8", "train.steps=24", "train.eval_every=8", "train.eval_batches=2", "optim.lr=3e-3",
            "optim.warmup_steps=2", "checkpoint.every_steps=8", "observe.log_every=1", "observe.progress=off",
            "observe.tensorboard=false", "observe.plot=false"]


def _metrics(run: Path, split: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["split"] == split}


def test_sft_lowers_the_held_out_loss_and_resumes_exactly(imported, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", chats(200))
    args = ["train", "lm", *sft_overrides(imported, data)]
    code, out, err = call(*args, "sample.max_new_tokens=6", "sample.prompt=What is the capital of Peru?",
                          "--run-dir", str(tmp_path / "whole"))
    assert code == 0, err
    assert "validation examples" in out and "nats per assistant token" in out and "sample reply" in out, out
    evals = _metrics(tmp_path / "whole", "eval")
    assert sorted(evals) == [8, 16, 24] and set(evals[8]) == {"step", "split", "loss"}
    first, last = evals[8]["loss"], evals[24]["loss"]
    print(f"held-out loss (nats per assistant token): step 8 {first:.4f} -> step 24 {last:.4f}")
    assert last < 0.7 * first

    stopped = ["train", "lm", *sft_overrides(imported, data), "sample.max_new_tokens=0", "--run-dir",
               str(tmp_path / "resumed")]
    assert call(*stopped, "loop.stop_at_step=12")[0] == 0
    assert max(_metrics(tmp_path / "resumed", "train")) == 12
    assert call(*stopped)[0] == 0
    for split in ("train", "eval"):
        whole = {s: r["loss"] for s, r in _metrics(tmp_path / "whole", split).items()}
        resumed = {s: r["loss"] for s, r in _metrics(tmp_path / "resumed", split).items()}
        assert resumed == whole, split
    assert (tmp_path / "resumed" / "chat_template.jinja").read_text() == CHATML


def test_a_small_chat_set_gets_a_batch_it_fills_and_the_log_says_so(imported, tmp_path):
    """34 conversations fill fewer rows than the recipe's 16: the batch is lowered to what they fill (a multiple of
    the 8 devices), with a warning; a batch the user sets is kept and refused with the settings that would work."""
    data = write_jsonl(tmp_path / "chats.jsonl", chats(34))
    args = [a for a in sft_overrides(imported, data) if not a.startswith("train.batch_size=")]
    with pytest.warns(UserWarning, match=r"train.batch_size lowered from 16 to 8: the 28 training examples fill 9 "
                                         r"rows .* train.steps=2 is then 2 passes over them"):
        code, _, err = call("train", "lm", *args, "train.steps=2", "sample.max_new_tokens=0", "--run-dir",
                            str(tmp_path / "run"))
    assert code == 0, err
    assert "batch_size: 8" in (tmp_path / "run" / "config.yaml").read_text()
    code, _, err = call("train", "lm", *args, "train.batch_size=16", "--run-dir", str(tmp_path / "asked"))
    assert code == 2 and "fewer than one batch of train.batch_size=16. Fix: train.batch_size=8, or data.seq_len=" in err
    assert not (tmp_path / "asked").exists()


# BAD INPUT ----------------------------------------------------------------------------------------------------

CHAT = ["train", "lm", *TINY_LM, "data.format=chat", "data.packing=documents", "sample.max_new_tokens=0", "-q"]


def test_bad_chat_data_is_one_paragraph_and_exit_2(tmp_path):
    conversation = {"messages": CONVERSATION}
    cases = [
        ([{"prompt": "a", "completion": "b"}, {"text": "hello"}], [],
         "line 2 has neither `messages` nor `prompt` and `completion`"),
        ([conversation, conversation], [], "has no chat template"),  # the byte tokenizer has none
        ([{"prompt": "a", "completion": 3}] * 2, [], "both strings"),
        ([], [], "holds 0 usable example(s)"),
        ([{"prompt": "a", "completion": "b"}] * 2, ["data.packing=concat"], "data.packing=documents"),
    ]
    for i, (records, extra, message) in enumerate(cases):
        path = write_jsonl(tmp_path / f"case{i}.jsonl", records)
        code, _, err = call(*CHAT, f"data.path={path}", *extra, "--run-dir", str(tmp_path / f"run{i}"))
        assert code == 2 and message in err and "Fix:" in err, (message, err)
        if i == 0:
            assert f"{path} line 2" in err
    code, _, err = call(*CHAT, "--run-dir", str(tmp_path / "nopath"))
    assert code == 2 and "data.format=chat reads chat records from data.path" in err


def test_a_conversation_without_an_assistant_turn_is_skipped_and_counted(tokenizer_dir, tmp_path):
    silent = {"messages": [{"role": "user", "content": "Hello?"}]}
    path = write_jsonl(tmp_path / "some.jsonl", [{"messages": CONVERSATION}, silent, {"messages": CONVERSATION}])
    skipped = rf"skipped 1 conversation\(s\) without an assistant message \(e.g. {path} line 2"
    with pytest.warns(UserWarning, match=skipped):
        data = sft.load_chat_corpus(str(path), make_tokenizer(str(tokenizer_dir)), seq_len=128, val_percent=50)
    assert data.skipped == 1 and sum(data.examples) == 2
    with pytest.raises(UserError, match=r"holds 1 usable example\(s\), after skipping 2 conversation"):
        sft.load_chat_corpus(str(write_jsonl(tmp_path / "none.jsonl", [silent, silent, {"messages": CONVERSATION}])),
                             make_tokenizer(str(tokenizer_dir)), seq_len=128, val_percent=50)


def test_long_examples_are_cut_to_a_row_and_counted(tokenizer_dir, tmp_path):
    long = {"prompt": "The capital of France is", "completion": " Paris." * 40}
    path = write_jsonl(tmp_path / "long.jsonl", [long, {"messages": CONVERSATION}, long])
    with pytest.warns(UserWarning, match="2 of 3 examples are longer than data.seq_len"):
        data = sft.load_chat_corpus(str(path), make_tokenizer(str(tokenizer_dir)), seq_len=96, val_percent=40)
    assert data.truncated == 2 and data.train.row_len == data.val.row_len == 97
    whole = len(find_chat_template(make_tokenizer(str(tokenizer_dir))).encode(CONVERSATION))
    assert whole < 97 and sum(data.tokens) == whole + 2 * 97, "the conversation whole, the others cut to a row"


@pytest.mark.slow  # two short runs on the imported model
def test_the_sft_and_dpo_recipes_take_the_imported_models_context(imported, tmp_path):
    """The recipes' data.seq_len (1,024) is longer than the imported model's 64 positions: unset on the command line,
    it becomes 64 with a warning that says so, and both recipes train; set there, the error's fix works as given."""
    data = write_jsonl(tmp_path / "chats.jsonl", chats(60))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"{a}:", "chosen": f" {b}.", "rejected": f" {a}."}
                                                   for a, b in CAPITALS.items()] * 4)
    quiet = ["train.steps=2", "train.batch_size=8", "train.eval_batches=1", "sample.max_new_tokens=0",
             "observe.progress=off", "observe.tensorboard=false", "observe.plot=false", "-q"]
    for recipe, path in (("sft", data), ("dpo", pairs)):
        run = tmp_path / recipe
        with pytest.warns(UserWarning, match=rf"data.seq_len set to 64, the context of the model init.from="
                                             rf"{imported} gives this run .* instead of the recipe's 1024"):
            code, _, err = call("train", "lm", "--recipe", recipe, f"init.from={imported}", f"data.path={path}",
                                *quiet, "--run-dir", str(run))
        assert code == 0, err
        assert "seq_len: 64" in (run / "config.yaml").read_text() and (run / "checkpoints" / "2").is_dir()
    asked = ["train", "lm", "--recipe", "sft", f"init.from={imported}", f"data.path={data}", *quiet]
    code, _, err = call(*asked, "data.seq_len=1024", "--run-dir", str(tmp_path / "asked"))
    assert code == 2 and "Fix: data.seq_len=64 (or shorter)" in err, err
    assert call(*asked, "data.seq_len=1024", "data.seq_len=64", "--run-dir", str(tmp_path / "fixed"))[0] == 0
