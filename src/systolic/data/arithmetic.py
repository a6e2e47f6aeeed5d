"""Arithmetic problems with checkable answers (`systolic data arithmetic`): a post-training task that needs no
download. Supervised fine-tuning learns the format from one set of problems, GRPO rewards correct answers on a
second, and a third, held out from both, measures accuracy.

    systolic data arithmetic --out data/arith --digits 2 --ops +,- --train 5000 --prompts 1000 --test 500

writes three .jsonl files to the folder, one problem a line: sft.jsonl (prompt/completion text for
`systolic train lm data.format=chat`), prompts.jsonl (GRPO's prompts with their `answer`) and test.jsonl (the same
form, held out from both). No problem appears twice, within a file or across them, and the files depend only on
the seed and the settings. `--teacher-slips P` gives a fraction P of the SFT problems that need a carry or a borrow
the answer of a teacher who forgets it; GRPO's prompts and the test keep the true answers, so the reward can correct
a model that learnt the habit (`--recipe arith-grpo`). The records, the draw order and the slips' rule, with
examples: docs/design-notes.md, this module's section.
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

    @property
    def slipped_answer(self) -> str:
        """The answer of a teacher who forgets every carry (+) or borrow (-): each column on its own, modulo 10,
        leading zeros dropped. Equals `answer` when the working needs no carry or borrow; * has no such slip."""
        if self.op == "*":
            raise ValueError("a multiplication has no carry-forgetting answer")
        width = len(str(max(self.a, self.b)))
        a, b = str(self.a).zfill(width), str(self.b).zfill(width)
        sign = 1 if self.op == "+" else -1
        columns = "".join(str((int(x) + sign * int(y)) % 10) for x, y in zip(a, b, strict=True))
        return str(int(columns))


@dataclasses.dataclass(frozen=True)
class Splits:
    """Disjoint problem sets: SFT's, GRPO's prompts and the held-out test. `slipped[i]`: the SFT record of
    `sft[i]` shows the teacher's slipped answer (`--teacher-slips`), not the true one."""

    sft: tuple[Problem, ...]
    prompts: tuple[Problem, ...]
    test: tuple[Problem, ...]
    slipped: tuple[bool, ...]


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


def make_splits(*, digits: int, ops: Sequence[str], train: int, prompts: int, test: int, seed: int,
                teacher_slips: float = 0.0) -> Splits:
    """`train` + `prompts` + `test` distinct problems drawn by `seed`: the test's first, then the prompts', then
    the SFT problems (so the first two do not depend on `train`). A fraction `teacher_slips` of the SFT problems
    that need a carry or borrow are marked slipped, by a second generator (so the draw is that of no slips)."""
    _check(digits, ops, train, prompts, test, seed, teacher_slips)
    rng = random.Random(seed)
    total = test + prompts + train
    drawn = _shuffled_space(rng, digits, ops)[:total] if 2 * total > space_size(digits, ops) else \
        _distinct_draws(rng, digits, ops, total)
    sft = tuple(drawn[test + prompts:])
    slip_rng = random.Random(f"teacher-slips {seed}")
    # One draw per SFT problem whether it can slip or not, so P changes which problems slip and no other draw.
    slipped = tuple(slip_rng.random() < teacher_slips and p.op != "*" and p.slipped_answer != p.answer for p in sft)
    return Splits(sft=sft, prompts=tuple(drawn[test:test + prompts]), test=tuple(drawn[:test]), slipped=slipped)


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


def _check(digits: int, ops: Sequence[str], train: int, prompts: int, test: int, seed: int,
           teacher_slips: float) -> None:
    if not 1 <= digits <= MAX_DIGITS:
        raise UserError(f"--digits {digits}: operands have 1 to {MAX_DIGITS} digits. Fix: e.g. --digits 2.")
    counts = {"--train": train, "--prompts": prompts, "--test": test}
    if any(count < 0 for count in counts.values()) or train + prompts + test == 0:
        given = " ".join(f"{flag} {count}" for flag, count in counts.items())
        raise UserError(f"{given}: each count must be >= 0 and at least one > 0. Fix: e.g. --train 5000 "
                        "--prompts 1000 --test 500.")
    if seed < 0:
        raise UserError(f"--seed {seed}: a seed is a non-negative integer. Fix: e.g. --seed 0.")
    if not 0.0 <= teacher_slips <= 1.0 or (teacher_slips > 0 and "*" in ops):
        raise UserError(f"--teacher-slips {teacher_slips} with --ops {','.join(ops)}: the share of carries and "
                        "borrows the SFT teacher forgets is a fraction in [0, 1], and only + and - have them. Fix: "
                        "e.g. --teacher-slips 0.7 --ops +, or --teacher-slips 0.")
    room = space_size(digits, ops)
    if train + prompts + test > room:
        raise UserError(
            f"{train} + {prompts} + {test} = {train + prompts + test} distinct problems asked of {digits}-digit "
            f"operands with {','.join(ops)}, which have only {room} distinct problems. Fix: raise --digits, add "
            "operators to --ops, or ask for fewer problems.")


def sft_record(problem: Problem, slipped: bool) -> dict[str, str]:
    """A prompt/completion record: lm's data.format=chat learns the completion and the end-of-text id after it.
    `slipped`: the teacher's carry-forgetting answer in place of the true one."""
    return {"prompt": problem.prompt, "completion": problem.slipped_answer if slipped else problem.answer}


def answer_record(problem: Problem) -> dict[str, str]:
    """A GRPO prompt (or held-out test) record: the prompt and the field that reward number_match checks."""
    return {"prompt": problem.prompt, "answer": problem.answer}


def write(out: Path, splits: Splits, *, force: bool = False) -> str:
    """Writes the three files of `splits` into `out` (created if needed), each whole or not at all; refuses to
    replace existing files unless `force`. Returns a line saying what was written."""
    out = outfile.check_folder(Path(out), option="--out")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; it must be a folder to hold {', '.join(FILES)}. Fix: name a folder.")
    paths = [outfile.check(out / name, option="--out", suffixes=(".jsonl",), force=force) for name in FILES]
    out.mkdir(parents=True, exist_ok=True)
    records = ([sft_record(p, slip) for p, slip in zip(splits.sft, splits.slipped, strict=True)],
               [answer_record(p) for p in splits.prompts], [answer_record(p) for p in splits.test])
    for path, file_records in zip(paths, records, strict=True):
        outfile.write_bytes(path, "".join(json.dumps(r) + "\n" for r in file_records).encode())
    slips = f" ({sum(splits.slipped):,} with the teacher's slipped answer)" if any(splits.slipped) else ""
    return (f"wrote {len(splits.sft):,} SFT problems{slips}, {len(splits.prompts):,} GRPO prompts and "
            f"{len(splits.test):,} held-out test problems to {out}/ ({', '.join(FILES)})")
