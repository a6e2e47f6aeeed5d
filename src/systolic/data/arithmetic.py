"""Arithmetic problems with checkable answers (`systolic data arithmetic`): a post-training task that needs no
download. Supervised fine-tuning learns the format from one set of problems, GRPO rewards correct answers on a
second, and a third, held out from both, measures accuracy.

    systolic data arithmetic --out data/arith --digits 2 --ops +,- --train 5000 --prompts 1000 --test 500

writes three .jsonl files to the folder, one problem a line:
- sft.jsonl: `{"prompt": "What is 37+45?\\n", "completion": "82"}`, for `systolic train lm data.format=chat`
  (prompt/completion text: the completion is learnt, then the end-of-text id, so a sampler stops after it);
- prompts.jsonl: `{"prompt": "What is 37+45?\\n", "answer": "82"}`, GRPO's prompts (reward number_match reads
  `answer`);
- test.jsonl: the same form, held out from both.

Operands are uniform in [0, 10**digits); a subtraction puts the larger operand first, so no answer is negative.
No problem appears twice, within a file or across them. The files depend only on the seed and the settings; the
test problems are drawn first and the GRPO prompts next, so asking for more or fewer SFT problems leaves those two
files as they were (as long as all three ask for at most half of the problems there are: beyond that, every problem
is listed and shuffled instead).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path

from systolic import outfile
from systolic.errors import UserError

OPS = ("+", "-", "*")
MAX_DIGITS = 9  # operands up to 10**9: far past what a model here learns, and exact in JSON's numbers
FILES = ("sft.jsonl", "prompts.jsonl", "test.jsonl")


@dataclasses.dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"What is {self.a}{self.op}{self.b}?\n"

    @property
    def answer(self) -> str:
        value = {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]
        return str(value)


@dataclasses.dataclass(frozen=True)
class Splits:
    """Disjoint problem sets: SFT's, GRPO's prompts and the held-out test."""

    sft: tuple[Problem, ...]
    prompts: tuple[Problem, ...]
    test: tuple[Problem, ...]


def parse_ops(text: str) -> tuple[str, ...]:
    """"+,-" -> ("+", "-"); a UserError for an unknown, repeated or missing operator."""
    ops = tuple(op.strip() for op in text.split(","))
    if not ops or any(op not in OPS for op in ops) or len(set(ops)) != len(ops):
        raise UserError(f"--ops {text!r}: expected a comma-separated list of distinct operators from {', '.join(OPS)}, "
                        "e.g. --ops +,- or --ops '*'. Fix: correct the list.")
    return ops


def space_size(digits: int, ops: Sequence[str]) -> int:
    """How many distinct problems there are: every ordered pair for + and *, pairs with a >= b for -."""
    n = 10**digits
    return sum(n * (n + 1) // 2 if op == "-" else n * n for op in ops)


def make_splits(*, digits: int, ops: Sequence[str], train: int, prompts: int, test: int, seed: int) -> Splits:
    """`train` + `prompts` + `test` distinct problems drawn by `seed`: the test's first, then the prompts', then
    the SFT problems (so the first two do not depend on `train`)."""
    _check(digits, ops, train, prompts, test, seed)
    rng = random.Random(seed)
    total = test + prompts + train
    drawn = _shuffled_space(rng, digits, ops)[:total] if 2 * total > space_size(digits, ops) else \
        _distinct_draws(rng, digits, ops, total)
    return Splits(sft=tuple(drawn[test + prompts:]), prompts=tuple(drawn[test:test + prompts]),
                  test=tuple(drawn[:test]))


def _distinct_draws(rng: random.Random, digits: int, ops: Sequence[str], count: int) -> list[Problem]:
    """`count` distinct random problems, drawn one by one: an operator, then each operand uniformly. Repeats are
    drawn again; with `count` at most half the space, each draw is new with probability >= 1/2."""
    n = 10**digits
    seen: set[Problem] = set()
    drawn: list[Problem] = []
    while len(drawn) < count:
        a, op, b = rng.randrange(n), ops[rng.randrange(len(ops))], rng.randrange(n)
        problem = Problem(max(a, b), op, min(a, b)) if op == "-" else Problem(a, op, b)
        if problem not in seen:
            seen.add(problem)
            drawn.append(problem)
    return drawn


def _shuffled_space(rng: random.Random, digits: int, ops: Sequence[str]) -> list[Problem]:
    """Every problem, shuffled: for requests of more than half the space, where drawing until each is new would
    repeat itself many times. (The space then holds fewer than twice the problems asked for.)"""
    n = 10**digits
    space = [Problem(a, op, b) for op in ops for a in range(n) for b in range(a + 1 if op == "-" else n)]
    rng.shuffle(space)
    return space


def _check(digits: int, ops: Sequence[str], train: int, prompts: int, test: int, seed: int) -> None:
    if not 1 <= digits <= MAX_DIGITS:
        raise UserError(f"--digits {digits}: operands have 1 to {MAX_DIGITS} digits. Fix: e.g. --digits 2.")
    counts = {"--train": train, "--prompts": prompts, "--test": test}
    if any(count < 0 for count in counts.values()) or train + prompts + test == 0:
        given = " ".join(f"{flag} {count}" for flag, count in counts.items())
        raise UserError(f"{given}: each count must be >= 0 and at least one > 0. Fix: e.g. --train 5000 "
                        "--prompts 1000 --test 500.")
    if seed < 0:
        raise UserError(f"--seed {seed}: a seed is a non-negative integer. Fix: e.g. --seed 0.")
    room = space_size(digits, ops)
    if train + prompts + test > room:
        raise UserError(
            f"{train} + {prompts} + {test} = {train + prompts + test} distinct problems asked of {digits}-digit "
            f"operands with {','.join(ops)}, which have only {room} distinct problems. Fix: raise --digits, add "
            "operators to --ops, or ask for fewer problems.")


def sft_record(problem: Problem) -> dict[str, str]:
    """A prompt/completion record: lm's data.format=chat learns the completion and the end-of-text id after it."""
    return {"prompt": problem.prompt, "completion": problem.answer}


def answer_record(problem: Problem) -> dict[str, str]:
    """A GRPO prompt (or held-out test) record: the prompt and the field that reward number_match checks."""
    return {"prompt": problem.prompt, "answer": problem.answer}


def write(out: Path, splits: Splits, *, force: bool = False) -> str:
    """Writes the three files of `splits` into `out` (created if needed), each whole or not at all; refuses to
    replace existing files unless `force`. Returns a line saying what was written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; it must be a folder to hold {', '.join(FILES)}. Fix: name a folder.")
    paths = [outfile.check(out / name, option="--out", suffixes=(".jsonl",), force=force) for name in FILES]
    out.mkdir(parents=True, exist_ok=True)
    sets = ((splits.sft, sft_record), (splits.prompts, answer_record), (splits.test, answer_record))
    for path, (problems, record) in zip(paths, sets, strict=True):
        lines = "".join(json.dumps(record(p)) + "\n" for p in problems)
        outfile.write_bytes(path, lines.encode())
    return (f"wrote {len(splits.sft):,} SFT problems, {len(splits.prompts):,} GRPO prompts and {len(splits.test):,} "
            f"held-out test problems to {out}/ ({', '.join(FILES)})")
