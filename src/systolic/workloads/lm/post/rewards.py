"""GRPO's rewards: the built-in verifiers, a user's functions named `module:function`, their weighted sum and TRL's
reward metrics. Everything here runs on the host, on the decoded completions' text.

Every reward function is called as `function(prompt, completion, fields) -> float`, one completion at a time, where
`fields` is the prompt's whole record (its `answer`, say). The built-ins:

- number_match: 1.0 when the completion's final number equals the record's answer numerically, else 0.0. The final
  number is the last number inside the last `\\boxed{...}` when the completion has one, else the last on the rest of
  the line after its last `####` (GSM8K's marker) when it has one, else the last in the whole text. Numbers are
  integers or decimals with an optional minus sign and optional thousands separators ("-1,234.50"); they compare as
  exact decimals (3.50 == 3.5). A number answer is taken as it is; a text answer by the same rule (so GSM8K's
  "... #### 72" works as it is).
- exact_match: 1.0 when the stripped completion, or its final answer, equals the stripped answer text (case and
  inner spaces count). The final answer is the last `\\boxed{...}`'s content, else the rest of the line after the
  last `####`, else the last non-empty line.
- format: 1.0 when `re.search(reward.format_pattern, completion)` finds a match (inline flags such as `(?s)` work).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from typing import Any

import numpy as np

from systolic.errors import ConfigError, UserError
from systolic.workloads.lm.post.config import RewardConfig

RewardFn = Callable[[str, str, dict], Any]
# A number not glued to a digit or a point before it (so "3-5" ends in 5, not -5): thousands-separated or plain
# digits, then an optional decimal part.
NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
# torch.isclose(std, 0)'s tolerance, with which TRL counts a group as having zero spread.
ZERO_STD_ATOL = 1e-8


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


@contextlib.contextmanager
def _working_directory_importable() -> Iterator[None]:
    """The working directory on sys.path while a user's module is imported (as `python -m` would have it), removed
    again after so it shadows no other import."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def load_function(spec: str) -> RewardFn:
    """Imports a user's reward function `module:function`; a ConfigError saying how to fix it when that fails."""
    module_name, _, attr = spec.partition(":")
    expected = (f"Expected {module_name}.py (importable from the working directory {os.getcwd()} or from PYTHONPATH) "
                f"defining {attr}(prompt: str, completion: str, fields: dict) -> float.")
    try:
        with _working_directory_importable():
            module = importlib.import_module(module_name)
    except Exception as e:  # a missing module, or any error its own code raises on import
        raise ConfigError(f"reward.functions names {spec}, but importing {module_name} failed ({type(e).__name__}: "
                          f"{e}). {expected} Fix: run systolic from the folder that holds {module_name}.py, or add "
                          "that folder to PYTHONPATH.") from e
    if not hasattr(module, attr):
        raise ConfigError(f"reward.functions names {spec}, but {module_name} ({module.__file__}) has no attribute "
                          f"'{attr}'. {expected} Fix: correct the name after the colon.")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(f"reward.functions names {spec}, but {module_name}.{attr} is {type(fn).__name__} "
                          f"{fn!r:.40}, not a function. {expected} Fix: name the function itself.")
    with contextlib.suppress(TypeError, ValueError):  # callables without a readable signature are called as they are
        signature = inspect.signature(fn)
        try:
            signature.bind("prompt", "completion", {})
        except TypeError as e:
            raise ConfigError(f"reward.functions names {spec}, whose signature {attr}{signature} cannot be called as "
                              f"{attr}(prompt, completion, fields) ({e}). {expected} Fix: give it those three "
                              "positional parameters.") from e
    return fn


# SCORING ------------------------------------------------------------------------------------------------------


class Rewards:
    """The reward section's functions, built once (user modules imported, the format pattern compiled): call it
    before anything is written, so an unimportable function stops the run with a ConfigError."""

    def __init__(self, cfg: RewardConfig):
        self.names = cfg.names  # metrics: rewards/<name>/mean
        self.weights = np.asarray(cfg.weight_values, np.float32)  # (F,)
        self._functions = tuple(self._build(spec, cfg) for spec in cfg.function_specs)

    @staticmethod
    def _build(spec: str, cfg: RewardConfig) -> RewardFn:
        if spec in ("number_match", "exact_match"):
            verifier = number_match if spec == "number_match" else exact_match
            return functools.partial(verifier, answer_field=cfg.answer_field)
        if spec == "format":
            return functools.partial(format_match, pattern=re.compile(cfg.format_pattern))
        return load_function(spec)

    def score(self, prompts: Sequence[str], completions: Sequence[str], fields: Sequence[dict], *,
              record_ids: Sequence[int | str] | None = None) -> np.ndarray:
        """Each function's reward of each completion, (N, F) float32. `fields[i]` is completion i's prompt record;
        `record_ids[i]` what errors name it by (its file:line, or by default its index i). A function that raises or
        returns anything but a finite real number (bools count as 1 and 0) is a UserError naming it and the
        record."""
        assert len(prompts) == len(completions) == len(fields), (len(prompts), len(completions), len(fields))
        scores = np.zeros((len(completions), len(self._functions)), np.float32)  # (N, F)
        for i, (prompt, completion, record) in enumerate(zip(prompts, completions, fields, strict=True)):
            where = f"record {i if record_ids is None else record_ids[i]} (prompt {prompt[:60]!r})"
            for j, fn in enumerate(self._functions):
                scores[i, j] = self._call(fn, self.names[j], where, prompt, completion, record)
        return scores

    @staticmethod
    def _call(fn: RewardFn, name: str, where: str, prompt: str, completion: str, record: dict) -> float:
        fix = f"Fix: make {name} return a finite float for every completion (try it on that record's prompt)."
        try:
            value = fn(prompt, completion, record)
        except UserError as e:  # a built-in's complaint about the record, with its own fix
            raise UserError(f"The reward {name} cannot score {where}: {e}") from e
        except Exception as e:
            raise UserError(f"The reward function {name} raised {type(e).__name__}: {e} on {where}. {fix}") from e
        if not isinstance(value, numbers.Real | np.bool_):
            raise UserError(f"The reward function {name} returned {type(value).__name__} {value!r:.60} on {where}, "
                            f"not a number. {fix}")
        if not math.isfinite(value):
            raise UserError(f"The reward function {name} returned {value} on {where}; rewards must be finite (a NaN "
                            f"or infinite reward would poison the group's advantages). {fix}")
        return float(value)

    def total(self, scores: np.ndarray) -> np.ndarray:
        """scores (N, F) -> each completion's reward (N,) float32: the functions' weighted sum (reward.weights)."""
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
