"""`systolic data arithmetic`: every answer is the arithmetic's, the three sets are disjoint and free of repeats,
the files depend only on the seed and settings, SFT records train as prompt/completion text ending in the
end-of-text id, and bad arguments are one paragraph, exit 2, nothing written."""

import json
from pathlib import Path

import numpy as np
import pytest

from systolic.cli import main
from systolic.data import arithmetic, packed
from systolic.data.sft import load_chat_corpus
from systolic.data.tokenizer import ByteTokenizer
from systolic.errors import UserError

SETTINGS = dict(digits=2, ops=("+", "-"), train=300, prompts=60, test=40, seed=0)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _solve(prompt: str) -> int:
    """The answer of "What is A<op>B?\\n", computed apart from the generator."""
    expression = prompt.removeprefix("What is ").removesuffix("?\n")
    for op, fn in (("+", int.__add__), ("-", int.__sub__), ("*", int.__mul__)):
        a, sep, b = expression.partition(op)
        if sep:
            return fn(int(a), int(b))
    raise AssertionError(f"no operator in {prompt!r}")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("arith") / "data"
    assert main(["data", "arithmetic", "--out", str(out), "--digits", "2", "--ops", "+,-", "--train", "300",
                 "--prompts", "60", "--test", "40", "--seed", "0"]) == 0
    return out


def test_answers_are_correct_and_sets_disjoint(written):
    sft, prompts, test = (_records(written / name) for name in arithmetic.FILES)
    assert (len(sft), len(prompts), len(test)) == (300, 60, 40)
    assert all(r["completion"] == str(_solve(r["prompt"])) for r in sft)
    assert all(r["answer"] == str(_solve(r["prompt"])) for r in prompts + test)
    assert all(int(r["answer"]) >= 0 for r in prompts + test)  # a subtraction puts the larger operand first
    sets = [{r["prompt"] for r in records} for records in (sft, prompts, test)]
    assert [len(s) for s in sets] == [300, 60, 40]  # no repeats within a file
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    ops = {op for r in sft for op in "+-" if op in r["prompt"]}
    assert ops == {"+", "-"}


def test_same_seed_same_files_and_test_set_independent_of_train_size(written, tmp_path):
    again = tmp_path / "again"
    assert main(["data", "arithmetic", "--out", str(again), "--digits", "2", "--ops", "+,-", "--train", "300",
                 "--prompts", "60", "--test", "40", "--seed", "0"]) == 0
    for name in arithmetic.FILES:
        assert (again / name).read_bytes() == (written / name).read_bytes()
    fewer = arithmetic.make_splits(**{**SETTINGS, "train": 100})
    other_seed = arithmetic.make_splits(**{**SETTINGS, "seed": 1})
    whole = arithmetic.make_splits(**SETTINGS)
    assert (fewer.test, fewer.prompts) == (whole.test, whole.prompts) and fewer.sft == whole.sft[:100]
    assert other_seed.test != whole.test


def test_the_whole_space_can_be_asked_for():
    """More than half the problems: drawn by shuffling every problem, still distinct and complete."""
    room = arithmetic.space_size(1, ("-", "*"))
    assert room == 55 + 100
    splits = arithmetic.make_splits(digits=1, ops=("-", "*"), train=room - 20, prompts=10, test=10, seed=3)
    problems = splits.sft + splits.prompts + splits.test
    assert len(set(problems)) == room
    assert all(p.a >= p.b for p in problems if p.op == "-")


def test_sft_records_learn_the_answer_then_end_of_text(written):
    """data.format=chat reads sft.jsonl as prompt/completion text: the answer's bytes and the end-of-text id are
    the tokens to learn, so a sampler trained on it stops after the answer."""
    tok = ByteTokenizer()
    corpus = load_chat_corpus(str(written / "sft.jsonl"), tok, seq_len=64, val_percent=10)
    assert corpus.examples[0] + corpus.examples[1] == 300 and corpus.truncated == 0
    row, flags = corpus.train.tokens[0], corpus.train.flags[0]  # (row_len,) each: whole examples, then padding
    starts = np.flatnonzero(flags & packed.START)
    for start, end in zip(starts[:-1], starts[1:]):  # each example of the row (the last start opens the padding)
        ids, learnt = row[start:end], row[start:end][(flags[start:end] & packed.LEARN) > 0]
        assert tok.decode(ids).startswith("What is ") and learnt[-1] == tok.eot_id
        assert tok.decode(ids) == tok.decode(ids[:len(ids) - len(learnt)]) + tok.decode(learnt[:-1])
        assert tok.decode(learnt[:-1]) == str(_solve(tok.decode(ids[:len(ids) - len(learnt)])))


def _forgetful(a: int, op: str, b: int) -> int:
    """A carry- (+) or borrow-forgetting (-) teacher's answer, column by column in place value, apart from the
    generator's string code."""
    sign = 1 if op == "+" else -1
    return sum(((a // 10**i % 10 + sign * (b // 10**i % 10)) % 10) * 10**i for i in range(len(str(max(a, b)))))


def test_teacher_slips_forget_carries_in_sft_only():
    """--teacher-slips P: that share of the SFT problems needing a carry or borrow show the forgetful answer; the
    rest, and every GRPO prompt and test problem, keep the true one; the problems drawn are those of P = 0."""
    clean = arithmetic.make_splits(**{**SETTINGS, "train": 2000})
    for share in (0.7, 1.0):
        slipped = arithmetic.make_splits(**{**SETTINGS, "train": 2000}, teacher_slips=share)
        assert (slipped.sft, slipped.prompts, slipped.test) == (clean.sft, clean.prompts, clean.test)
        answers = [arithmetic.sft_record(p, s)["completion"] for p, s in zip(slipped.sft, slipped.slipped)]
        carries = [p for p in slipped.sft if _forgetful(p.a, p.op, p.b) != _solve(p.prompt)]
        assert len(carries) > 500  # 2-digit + and -: most problems need a carry or borrow
        for problem, shown, slip in zip(slipped.sft, answers, slipped.slipped, strict=True):
            assert int(shown) == (_forgetful(problem.a, problem.op, problem.b) if slip else _solve(problem.prompt))
        share_seen = sum(slipped.slipped) / len(carries)
        assert share_seen == 1.0 if share == 1.0 else abs(share_seen - share) < 0.05
    assert not any(clean.slipped)
    assert [arithmetic.Problem(37, "+", 45).slipped_answer, arithmetic.Problem(97, "+", 50).slipped_answer,
            arithmetic.Problem(80, "-", 29).slipped_answer] == ["72", "47", "61"]


@pytest.mark.parametrize("argv, message", [
    (["--digits", "0"], "--digits 0"),
    (["--digits", "10"], "--digits 10"),
    (["--ops", "+,/"], "--ops '+,/'"),
    (["--ops", "+,+"], "distinct operators"),
    (["--train", "-1"], "each count must be >= 0"),
    (["--train", "0", "--prompts", "0", "--test", "0"], "at least one > 0"),
    (["--seed", "-3"], "--seed -3"),
    (["--digits", "1", "--train", "200"], "only 155 distinct problems"),
    (["--teacher-slips", "1.5"], "--teacher-slips 1.5"),
    (["--teacher-slips", "0.5", "--ops", "+,*"], "only + and - have them"),
])
def test_bad_arguments_exit_2_and_write_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["data", "arithmetic", "--out", str(out), *argv]) == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not out.exists()


def test_existing_files_are_kept_unless_forced(written, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["data", "arithmetic", "--out", str(out), "--train", "10", "--prompts", "0", "--test", "0"]) == 0
    before = (out / "sft.jsonl").read_bytes()
    assert main(["data", "arithmetic", "--out", str(out), "--train", "10", "--seed", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the paragraph is wrapped to the terminal's width
    assert "already exists" in err and (out / "sft.jsonl").read_bytes() == before
    assert main(["data", "arithmetic", "--out", str(out), "--train", "10", "--seed", "1", "--force"]) == 0
    assert (out / "sft.jsonl").read_bytes() != before
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a file"):
        arithmetic.write(tmp_path / "file", arithmetic.make_splits(**SETTINGS))
