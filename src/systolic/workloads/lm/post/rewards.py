"""GRPO's rewards: the built-in verifiers, a user's functions named `module:function`, their weighted sum and TRL's
reward metrics. Everything here runs on the host, on the decoded completions' text.

Every reward function is called as `function(prompt, completion, fields) -> float`, one completion at a time, where
`fields` is the prompt's whole record (its `answer`, say). The built-ins:

- number_match: 1.0 when the completion's final number equals the record's answer numerically, else 0.0. The final
  number is the last number inside the last `\\boxed{...}`, else after the last `####` (GSM8K's marker), else in
  the whole text; numbers compare as exact decimals (3.50 == 3.5) (in full: docs/design-notes.md, this module's
  section).
- exact_match: 1.0 when the stripped completion, or its final answer, equals the stripped answer text (case and
  inner spaces count). The final answer is the last `\\boxed{...}`'s content, else the rest of the line after the
  last `####`, else the last non-empty line.
- format: 1.0 when `re.search(reward.format_pattern, completion)` finds a match (inline flags such as `(?s)` work).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import numbers
import os
import re
import signal
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from typing import Any

import numpy as np

from systolic.data.template_sandbox import WorkerProcess
from systolic.errors import ConfigError, UserError
from systolic.workloads.lm.post import reward_worker
from systolic.workloads.lm.config import BUILT_IN_REWARDS, RewardConfig

RewardFn = Callable[[str, str, dict], Any]
# A number not glued to a digit or a point before it (so "3-5" ends in 5, not -5): thousands-separated or plain
# digits, then an optional decimal part.
NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
# torch.isclose(std, 0)'s tolerance, with which TRL counts a group as having zero spread.
ZERO_STD_ATOL = 1e-8
# A user's reward module's import (torch alone takes seconds): its own deadline, or reward.timeout_s if longer.
IMPORT_TIMEOUT_S = 120.0


# BUILT-IN VERIFIERS -------------------------------------------------------------------------------------------


def final_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), else the rest of the line after the last `####`,
    else None."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, begin = 0, start + len("\\boxed{")
        for i in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth < 0:
                return text[begin:i]
        return text[begin:]  # unclosed: the completion was cut off inside the box
    marker = text.rfind("####")
    return text[marker + 4:].split("\n", 1)[0] if marker >= 0 else None  # a model may write on after the answer


def last_number(text: str) -> Decimal | None:
    """The final number of a text by number_match's rule (module docstring), or None if it has none."""
    region = final_answer(text)
    found = NUMBER.findall(text if region is None else region)
    return Decimal(found[-1].replace(",", "")) if found else None


def answer_of(fields: dict, answer_field: str) -> Any:
    if answer_field not in fields:
        raise UserError(f"the record has no field '{answer_field}' (its fields: {', '.join(map(str, fields))}). "
                        f"Fix: give every prompt record its answer under '{answer_field}', or point "
                        "reward.answer_field at the field that holds it.")
    return fields[answer_field]


def number_match(prompt: str, completion: str, fields: dict, *, answer_field: str) -> float:
    answer = answer_of(fields, answer_field)
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        expected = Decimal(str(answer))  # str(): 0.1 is the decimal 0.1 it was written as, not the float's binary value
    elif isinstance(answer, str):
        expected = last_number(answer)
    else:
        expected = None
    if expected is None or not expected.is_finite():
        raise UserError(f"its '{answer_field}' field ({answer!r:.60}) holds no finite number, which number_match "
                        "compares the completion's final number with. Fix: write the answer as a number (42, "
                        "\"1,234\", \"#### 42\"), or use exact_match for answers that are not numbers.")
    got = last_number(completion)
    return 1.0 if got is not None and got == expected else 0.0


def exact_match(prompt: str, completion: str, fields: dict, *, answer_field: str) -> float:
    answer = str(answer_of(fields, answer_field)).strip()
    region = final_answer(completion)
    if region is None:
        lines = [line for line in completion.splitlines() if line.strip()]
        region = lines[-1] if lines else ""
    return 1.0 if answer in (completion.strip(), region.strip()) else 0.0


def format_match(prompt: str, completion: str, fields: dict, *, pattern: re.Pattern) -> float:
    return 1.0 if pattern.search(completion) else 0.0


# THE USER'S FUNCTIONS -----------------------------------------------------------------------------------------


class UserRewards:
    """The user's functions (`module:function` specs), imported and called in a worker process (reward_worker.py:
    why a process) that is started here and again after it was stopped. Every failure is a ConfigError (at import)
    or a UserError (on a record) in one paragraph; the worker's own failure never reaches this process."""

    def __init__(self, specs: Sequence[str], timeout_s: float):
        self.specs, self.timeout_s = tuple(specs), timeout_s
        # `python -c`: the working directory first on sys.path (as `python -m` has it), not the worker's own folder.
        self._worker = WorkerProcess(
            [sys.executable, "-c", f"import runpy; runpy.run_path({reward_worker.__file__!r}, run_name='__main__')"])
        weakref.finalize(self, self._worker.stop)
        self._load()

    def scores(self, calls: list[tuple[int, str, str, dict]], names: Sequence[str],
               where: Sequence[str]) -> Iterator[Any]:
        """Each call's value (function index into `specs`, prompt, completion, record), in order; `names[i]` and
        `where[i]` name call i's function and record in errors. A value is checked by the caller."""
        if not self._worker.running:  # stopped after a failure: a fresh worker imports the functions again
            self._load()
        self._worker.send({"calls": calls})
        for i in range(len(calls)):
            answer = self._receive(f"while the reward function {names[i]} scored {where[i]}", self.timeout_s)
            if "value" in answer:
                yield answer["value"]
                continue
            self._worker.stop()  # the rest of the batch's answers are not read: the next request starts afresh
            fix = f"Fix: make {names[i]} return a finite float for every completion (try it on that record's prompt)."
            if "raised" in answer:
                raise UserError(f"The reward function {names[i]} raised {answer['raised']} on {where[i]}. {fix}")
            raise UserError(f"The reward function {names[i]} returned {answer['returned']} on {where[i]}, not a "
                            f"number. {fix}")

    def _load(self) -> None:
        self._worker.send({"load": list(self.specs)})
        answer = self._receive("while importing the reward functions", max(IMPORT_TIMEOUT_S, self.timeout_s),
                               config=True)
        if "problem" in answer:
            self._worker.stop()
            raise _unusable(answer)

    def _receive(self, doing: str, timeout_s: float, *, config: bool = False) -> dict[str, Any]:
        """The worker's next answer; a UserError (ConfigError with `config`) when it ends or is late."""
        line = self._worker.receive(timeout_s)
        error = ConfigError if config else UserError
        if line is None:
            raise error(f"The process running the reward functions {', '.join(self.specs)} did not answer within "
                        f"{timeout_s:g} s {doing}, so it was stopped: a function that never returns (or runs that "
                        "long) would stall the run. Fix: make it return sooner, or raise the limit per call with "
                        f"reward.timeout_s (now {self.timeout_s:g}).")
        if not line:
            raise error(f"The process running the reward functions {', '.join(self.specs)} ended {doing} (exit "
                        f"status {_status(self._worker.exit_status)}): the function's own code ended or crashed it "
                        "(os._exit, a crash in a C extension). Nothing of the run was changed by it. Fix: run the "
                        "function on that record by hand (`python -c 'import module; print(module.function(prompt, "
                        "completion, fields))'`) and make it return a float.")
        return json.loads(line)


def _status(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"{code}, signal {signal.Signals(-code).name}"
    return str(code)


def _unusable(answer: dict[str, Any]) -> ConfigError:
    """The ConfigError for the worker's `problem` with a user function's spec."""
    spec = answer["spec"]
    module_name, _, attr = spec.partition(":")
    expected = (f"Expected {module_name}.py (importable from the working directory {os.getcwd()} or from PYTHONPATH) "
                f"defining {attr}(prompt: str, completion: str, fields: dict) -> float.")
    problem, detail = answer["problem"], answer.get("detail")
    if problem == "import":
        return ConfigError(f"reward.functions names {spec}, but importing {module_name} failed ({detail}). {expected} "
                           f"Fix: run systolic from the folder that holds {module_name}.py, or add that folder to "
                           "PYTHONPATH (and let its code import without exiting).")
    if problem == "missing":
        return ConfigError(f"reward.functions names {spec}, but {module_name} ({answer['file']}) has no attribute "
                           f"'{attr}'. {expected} Fix: correct the name after the colon.")
    if problem == "not_callable":
        return ConfigError(f"reward.functions names {spec}, but {module_name}.{attr} is {detail}, not a function. "
                           f"{expected} Fix: name the function itself.")
    return ConfigError(f"reward.functions names {spec}, whose signature {detail} cannot be called as "
                       f"{attr}(prompt, completion, fields). {expected} Fix: give it those three positional "
                       "parameters.")


# SCORING ------------------------------------------------------------------------------------------------------


class Rewards:
    """The reward section's functions, built once (user modules imported in their worker, the format pattern
    compiled): call it before anything is written, so an unimportable function stops the run with a ConfigError."""

    def __init__(self, cfg: RewardConfig):
        self.names = cfg.names  # metrics: rewards/<name>/mean
        self.weights = np.asarray(cfg.weight_values, np.float32)  # (F,)
        specs = cfg.function_specs
        self._builtins = {j: self._built_in(spec, cfg) for j, spec in enumerate(specs) if spec in BUILT_IN_REWARDS}
        self._users = [j for j in range(len(specs)) if j not in self._builtins]  # columns of the user's functions
        users = [specs[j] for j in self._users]
        self._worker = UserRewards(users, cfg.timeout_s) if users else None

    @staticmethod
    def _built_in(spec: str, cfg: RewardConfig) -> RewardFn:
        if spec in ("number_match", "exact_match"):
            verifier = number_match if spec == "number_match" else exact_match
            return functools.partial(verifier, answer_field=cfg.answer_field)
        return functools.partial(format_match, pattern=re.compile(cfg.format_pattern))

    def score(self, prompts: Sequence[str], completions: Sequence[str], fields: Sequence[dict], *,
              record_ids: Sequence[int | str] | None = None) -> np.ndarray:
        """Each function's reward of each completion, (N, F) float32. `fields[i]` is completion i's prompt record;
        `record_ids[i]` what errors name it by (its file:line, or by default its index i). A function that raises,
        exits, crashes, runs past reward.timeout_s or returns anything but a real number finite in float32 (bools
        count as 1 and 0) is a UserError naming it and the record."""
        assert len(prompts) == len(completions) == len(fields), (len(prompts), len(completions), len(fields))
        scores = np.zeros((len(completions), len(self.names)), np.float32)  # (N, F)
        where = [f"record {i if record_ids is None else record_ids[i]} (prompt {p[:60]!r})"
                 for i, p in enumerate(prompts)]
        for i, (prompt, completion, record) in enumerate(zip(prompts, completions, fields, strict=True)):
            for j, fn in self._builtins.items():
                try:
                    value = fn(prompt, completion, record)
                except UserError as e:  # a built-in's complaint about the record, with its own fix
                    raise UserError(f"The reward {self.names[j]} cannot score {where[i]}: {e}") from e
                scores[i, j] = value
        if self._worker is not None:
            calls, names, places = [], [], []  # completion by completion, each user function in turn
            for i, (prompt, completion, record) in enumerate(zip(prompts, completions, fields, strict=True)):
                for k, j in enumerate(self._users):
                    calls.append((k, prompt, completion, record))
                    names.append(self.names[j])
                    places.append(where[i])
            for n, value in enumerate(self._worker.scores(calls, names, places)):
                i, k = divmod(n, len(self._users))
                scores[i, self._users[k]] = _checked(value, names[n], places[n])
        return scores

    def check_groups(self, totals: np.ndarray, advantages: np.ndarray, group_size: int,
                     record_ids: Sequence[int | str]) -> None:
        """A UserError naming the first group whose weighted rewards (N,) or advantages (N,) are not finite in
        float32: each reward may be finite while their weighted sum, or the squares of the group's spread, are not."""
        bad = ~(np.isfinite(totals) & np.isfinite(advantages)).reshape(-1, group_size).all(axis=1)  # (N / G,)
        if bad.any():
            g = int(np.argmax(bad))
            group = slice(g * group_size, (g + 1) * group_size)
            raise UserError(
                f"The rewards of the group of completions of record {record_ids[g * group_size]} (weighted sums "
                f"{totals[group].tolist()}) give advantages {advantages[group].tolist()}: their weighted sum, mean or "
                "spread is past float32's range (about 3.4e38, and its square root 1.8e19 for the spread), so the "
                "update would be NaN. Fix: keep each reward well within +-1e18 (e.g. rewards in [0, 1]), and "
                "reward.weights modest.")

    def total(self, scores: np.ndarray) -> np.ndarray:
        """scores (N, F) -> each completion's reward (N,) float32: the functions' weighted sum (reward.weights)."""
        with np.errstate(over="ignore"):  # a sum past float32 is inf, which check_groups reports in its paragraph
            return scores @ self.weights  # (N,)

    def metrics(self, scores: np.ndarray, group_size: int) -> dict[str, float]:
        """TRL's reward metrics of a batch of N completions in N / group_size consecutive groups: rewards/<name>/mean
        and /std per function, reward and reward_std of the weighted sum, and frac_reward_zero_std, the share of
        groups whose rewards are all equal (no advantage, so no learning signal). Stds are unbiased, as TRL's."""
        totals = self.total(scores)  # (N,)
        out = {}
        for j, name in enumerate(self.names):
            out[f"rewards/{name}/mean"] = float(scores[:, j].mean())
            out[f"rewards/{name}/std"] = float(_std(scores[:, j]))
        out["reward"] = float(totals.mean())
        out["reward_std"] = float(_std(totals))
        group_std = _std(totals.reshape(-1, group_size), axis=1)  # (N / G,)
        out["frac_reward_zero_std"] = float((np.abs(group_std) <= ZERO_STD_ATOL).mean())
        return out


def _std(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """The unbiased (n - 1) standard deviation in float32, as TRL's nanstd (every group has at least 2 values)."""
    return np.std(x, axis=axis, ddof=1, dtype=np.float32)


def _checked(value: Any, name: str, where: str) -> float:
    """A user function's returned `value` (a JSON number or boolean) as the float32 it is kept as."""
    fix = f"Fix: make {name} return a finite float for every completion (try it on that record's prompt)."
    try:
        as_float = float(value)
    except OverflowError:  # an integer past float's range (10**400)
        raise UserError(f"The reward function {name} returned the integer {str(value)[:20]}... ({len(str(value))} "
                        f"digits) on {where}, past float's range. {fix}") from None
    if not math.isfinite(as_float):
        raise UserError(f"The reward function {name} returned {as_float} on {where}; rewards must be finite (a NaN "
                        f"or infinite reward would poison the group's advantages). {fix}")
    with np.errstate(over="ignore"):  # the overflow is the finding, not a warning
        kept = np.float32(as_float)
    if not np.isfinite(kept):
        raise UserError(f"The reward function {name} returned {as_float:g} on {where}, which is finite as a Python "
                        f"float but past float32's range (about 3.4e38), in which rewards are kept. {fix}")
    return as_float
