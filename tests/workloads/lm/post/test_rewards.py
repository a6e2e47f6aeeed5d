"""GRPO's rewards (post/rewards.py): the built-in verifiers on a table of cases, the reward section's checks, users'
functions and their errors, weights, and TRL's reward metrics."""

import math
import re
import sys
import textwrap

import numpy as np
import pytest

from systolic import config as config_lib
from systolic.errors import ConfigError, UserError
from systolic.workloads.lm.config import RewardConfig
from systolic.workloads.lm.post.rewards import Rewards, exact_match, format_match, number_match


def reward_config(**keys) -> RewardConfig:
    return config_lib.from_dict(RewardConfig, keys, "reward.")


@pytest.mark.parametrize("completion, answer, want", [
    ("The answer is 42.", 42, 1.0),
    ("The answer is 42.", "42", 1.0),
    ("So 6 * 7 = 42, then 43", 42, 0.0),  # the last number counts
    ("#### 1,234", "1234", 1.0),
    ("12345", "12,345", 1.0),
    ("x = -3", -3, 1.0),
    ("pages 3-5", 5, 1.0),  # a hyphen after a digit is no minus sign
    ("pages 3-5", -5, 0.0),
    ("It is 3.50 dollars", 3.5, 1.0),
    ("0.1 + 0.2 = 0.3", 0.3, 1.0),  # compared as the decimals written, not as binary floats
    ("I count 1,2,3", 3, 1.0),  # a list, not a thousands separator
    ("-1,234.5 it is", -1234.5, 1.0),
    ("\\boxed{7} after checking 8", 7, 1.0),  # the box wins over later numbers
    ("\\boxed{\\frac{1}{2}} x", 2, 1.0),  # braces balanced; the box's last number
    ("#### 72\nQuestion: what is 5 + 5?", 72, 1.0),  # the rest of the #### line, not what the model wrote on
    ("#### seventy-two and 3", 3, 1.0),
    ("no numbers here", 1, 0.0),
    ("", 0, 0.0),
    ("Natalia sold 72 clips", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # GSM8K's answer field as is
])
def test_number_match(completion, answer, want):
    assert number_match("p", completion, {"answer": answer}, answer_field="answer") == want


@pytest.mark.parametrize("completion, answer, want", [
    ("Paris", "Paris", 1.0),
    ("  Paris \n", " Paris", 1.0),
    ("Let me think.\nParis\n\n", "Paris", 1.0),  # the last non-empty line
    ("Let me think.\nParis it is", "Paris", 0.0),
    ("paris", "Paris", 0.0),  # case counts
    ("The capital is \\boxed{Paris}. Done.", "Paris", 1.0),
    ("#### Paris\nmore text", "Paris", 1.0),
    ("#### 42", 42, 1.0),  # a number answer compares as its text
    ("", "Paris", 0.0),
])
def test_exact_match(completion, answer, want):
    assert exact_match("p", completion, {"answer": answer}, answer_field="answer") == want


@pytest.mark.parametrize("pattern, completion, want", [
    (r"<answer>.*</answer>", "think... <answer>4</answer>", 1.0),
    (r"^<answer>", "x <answer>4</answer>", 0.0),  # re.search, but anchors still anchor
    (r"<think>.*</think>", "<think>a\nb</think>", 0.0),  # . stops at a newline...
    (r"(?s)<think>.*</think>", "<think>a\nb</think>", 1.0),  # ...unless the pattern says otherwise
])
def test_format(pattern, completion, want):
    assert format_match("p", completion, {}, pattern=re.compile(pattern)) == want


@pytest.mark.parametrize("keys, message", [
    ({"functions": ""}, "reward.functions is empty"),
    ({"functions": "number_match, lenght"}, "'lenght', which is neither a built-in"),
    ({"functions": "my rewards:f"}, "neither a built-in"),
    ({"functions": "number_match,number_match"}, "names a function twice"),
    ({"functions": "a:score,b.c:score"}, "names a function twice"),
    ({"functions": "number_match,exact_match", "weights": "1"}, "must be 2 finite numbers"),
    ({"weights": "one"}, "must be 1 finite numbers"),
    ({"weights": "nan"}, "must be 1 finite numbers"),
    ({"weights": "inf"}, "must be 1 finite numbers"),
    ({"functions": "format"}, "reward.format_pattern is empty"),
    ({"format_pattern": "x"}, "has no format reward, so it would do nothing"),
    ({"functions": "format", "format_pattern": "(unclosed"}, "is not a valid regular expression"),
    ({"answer_field": ""}, "reward.answer_field is empty"),
    ({"timeout_s": 0}, "reward.timeout_s=0 is out of range"),
    ({"timeout_s": 1e9}, "at most 86400 seconds"),
])
def test_bad_reward_settings_are_config_errors(keys, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        reward_config(**keys)


def test_builtins_score_weigh_and_name_their_columns():
    rewards = Rewards(reward_config(functions="number_match, exact_match,format", weights="2,0.5,-1",
                                    answer_field="solution", format_pattern=r"####"))
    assert rewards.names == ("number_match", "exact_match", "format")
    scores = rewards.score(["q1", "q2"], ["#### 12", "it is 12"], [{"solution": 12}, {"solution": "it is 12"}])
    np.testing.assert_array_equal(scores, np.array([[1, 1, 1], [1, 1, 0]], np.float32))
    assert scores.dtype == np.float32
    np.testing.assert_allclose(rewards.total(scores), [2 + 0.5 - 1, 2 + 0.5])


def test_reward_metrics_equal_trls_formulas():
    """TRL's _generate_and_score_completions logging, with its own nanstd and torch.isclose, on the same rewards."""
    torch = pytest.importorskip("torch")
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    rewards = Rewards(reward_config(functions="number_match,exact_match", weights="1,0.5"))
    scores = np.array([[1, 1], [1, 1], [1, 1], [0, 1], [1, 0], [0, 0]], np.float32)  # 2 groups of 3; the first equal
    got = rewards.metrics(scores, group_size=3)
    per_func = torch.tensor(scores)
    total = (per_func * torch.tensor([1.0, 0.5])).nansum(dim=1)
    std = nanstd(total.view(-1, 3), dim=1).repeat_interleave(3)
    want = {f"rewards/{name}/{stat}": fn(per_func[:, j]) for j, name in enumerate(("number_match", "exact_match"))
            for stat, fn in (("mean", torch.nanmean), ("std", nanstd))}
    want |= {"reward": torch.nanmean(total), "reward_std": nanstd(total),
            "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean()}
    assert set(got) == set(want)
    for name, value in want.items():
        assert math.isclose(got[name], value.item(), rel_tol=1e-6, abs_tol=1e-7), name
    assert got["frac_reward_zero_std"] == 0.5


# USERS' FUNCTIONS ---------------------------------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes a module into a fresh working directory (importable only from there); forgets it afterwards."""
    monkeypatch.chdir(tmp_path)
    written = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


USER_REWARDS = """
    import numpy as np

    def length(prompt, completion, fields):
        return len(completion) / fields["scale"]

    def is_long(prompt, completion, fields):
        return len(completion) > 3

    def as_numpy(prompt, completion, fields):
        return np.float32(0.25)

    # These go wrong on the completion "4" only.
    def boom(prompt, completion, fields):
        return fields["scale"]

    def nan(prompt, completion, fields):
        return float("nan") if completion == "4" else 1.0

    def text(prompt, completion, fields):
        return "1.0" if completion == "4" else 1.0

    def nothing(prompt, completion, fields):
        return None if completion == "4" else 1.0

    def two_args(prompt, completion):
        return 1.0

    NOT_A_FUNCTION = 3
"""


def test_user_functions_import_from_the_working_directory_and_score(user_module):
    name = user_module("rewards_ok", USER_REWARDS)
    path_before = list(sys.path)
    rewards = Rewards(reward_config(functions=f"{name}:length,{name}:is_long,{name}:as_numpy,number_match",
                                    weights="1,2,4,1"))
    assert sys.path == path_before  # the working directory was on it only while importing
    assert rewards.names == ("length", "is_long", "as_numpy", "number_match")
    scores = rewards.score(["p", "p"], ["12", "1234"], [{"scale": 4, "answer": 12}, {"scale": 2, "answer": 1}])
    np.testing.assert_allclose(scores, [[0.5, 0.0, 0.25, 1.0], [2.0, 1.0, 0.25, 0.0]])  # a bool counts as 1 or 0
    np.testing.assert_allclose(rewards.total(scores), [0.5 + 1 + 1, 2 + 2 + 1])


@pytest.mark.parametrize("function, message", [
    ("boom", r"The reward function boom raised KeyError: 'scale' on record 7 \(prompt 'What is 2\+2\?'\)"),
    ("nan", r"The reward function nan returned nan on record 7 .*must be finite"),
    ("text", r"The reward function text returned str '1.0' on record 7 .*not a number"),
    ("nothing", r"The reward function nothing returned NoneType None on record 7 .*not a number"),
])
def test_bad_rewards_name_the_function_and_the_record(user_module, function, message):
    name = user_module("rewards_bad", USER_REWARDS)
    rewards = Rewards(reward_config(functions=f"{name}:{function}"))
    rewards.score(["fine"], ["ok"], [{"scale": 1}], record_ids=[3])  # only some records go wrong
    with pytest.raises(UserError, match=message):
        rewards.score(["fine", "What is 2+2?"], ["ok", "4"], [{"scale": 1}, {}], record_ids=[3, 7])


def test_a_record_without_its_answer_is_named(user_module):
    rewards = Rewards(reward_config(functions="number_match"))
    with pytest.raises(UserError, match=r"The reward number_match cannot score record 1 \(prompt 'q'\): the record "
                                        r"has no field 'answer' \(its fields: question\)"):
        rewards.score(["p", "q"], ["1", "2"], [{"answer": 1}, {"question": "q"}])
    with pytest.raises(UserError, match=r"record 0 .*'answer' field \('unknown'\) holds no finite number"):
        rewards.score(["p"], ["1"], [{"answer": "unknown"}])


@pytest.mark.parametrize("spec, message", [
    ("no_such_module:f", r"importing no_such_module failed \(ModuleNotFoundError"),
    ("{mod}:missing", "has no attribute 'missing'"),
    ("{mod}:NOT_A_FUNCTION", "is int 3, not a function"),
    ("{mod}:two_args", r"cannot be called as two_args\(prompt, completion, fields\)"),
    ("{broken}:f", r"importing rewards_broken failed \(ZeroDivisionError"),
])
def test_unusable_user_functions_are_config_errors(user_module, spec, message):
    mod = user_module("rewards_checked", USER_REWARDS)
    broken = user_module("rewards_broken", "x = 1 / 0\n")
    with pytest.raises(ConfigError, match=message):
        Rewards(reward_config(functions=spec.format(mod=mod, broken=broken)))


# USERS' CODE THAT WOULD TAKE THE RUN DOWN (issue 45) ----------------------------------------------------------

HOSTILE_REWARDS = """
    import ctypes, os, sys, time

    class Escape(BaseException):
        pass

    def fine(prompt, completion, fields):
        return 0.5

    def hangs(prompt, completion, fields):
        time.sleep(3600)

    def exits(prompt, completion, fields):
        sys.exit(0)

    def hard_exit(prompt, completion, fields):
        os._exit(1)

    def segfault(prompt, completion, fields):
        ctypes.string_at(0)

    def huge_int(prompt, completion, fields):
        return 10**400

    def past_float32(prompt, completion, fields):
        return 1e300

    def escapes(prompt, completion, fields):
        raise Escape("out of the loop")

    def prints(prompt, completion, fields):
        print("a line on stdout", flush=True)
        os.write(1, b"and one from C")
        return 1.0

    def large(prompt, completion, fields):
        return 3e38 if completion == "a" else 1.0
"""


@pytest.mark.parametrize("function, message", [
    ("hangs", r"did not answer within 1 s while the reward function hangs scored record 3 .*reward.timeout_s"),
    ("exits", r"The reward function exits raised SystemExit: 0 on record 3"),
    ("hard_exit", r"ended while the reward function hard_exit scored record 3 .*\(exit status 1\)"),
    ("segfault", r"ended while the reward function segfault scored record 3 .*signal SIGSEGV"),
    ("huge_int", r"huge_int returned the integer 1000000000000000000\d*\.\.\. \(401 digits\) on record 3"),
    ("past_float32", r"past_float32 returned 1e\+300 on record 3 .*past float32's range"),
    ("escapes", r"escapes raised Escape: out of the loop on record 3"),
])
def test_a_user_function_that_would_take_the_run_down_is_one_error_and_the_next_call_works(user_module, function,
                                                                                           message):
    """Each runs in the worker process: this process goes on, names the function and the record, and a good
    function beside it scores on a fresh worker afterwards."""
    name = user_module("rewards_hostile", HOSTILE_REWARDS)
    rewards = Rewards(reward_config(functions=f"{name}:fine,{name}:{function}", weights="1,1", timeout_s=1))
    with pytest.raises(UserError, match=message):
        rewards.score(["q"], ["a"], [{}], record_ids=[3])
    good = Rewards(reward_config(functions=f"{name}:fine,{name}:prints", weights="1,1"))
    np.testing.assert_array_equal(good.score(["q", "q"], ["a", "b"], [{}, {}]), [[0.5, 1.0], [0.5, 1.0]])


@pytest.mark.parametrize("source, message", [
    ("import sys\nsys.exit(0)\n", r"importing rewards_import_\w+ failed \(SystemExit: 0\)"),
    ("import os\nos._exit(3)\n", r"ended while importing the reward functions \(exit status 3\)"),
    ("raise KeyboardInterrupt\n", r"failed \(KeyboardInterrupt"),
])
def test_a_module_that_exits_at_import_is_a_config_error(user_module, source, message):
    name = user_module(f"rewards_import_{abs(hash(source)) % 1000}", source + "def f(prompt, completion, fields):\n"
                       "    return 1.0\n")
    with pytest.raises(ConfigError, match=message):
        Rewards(reward_config(functions=f"{name}:f"))


def test_rewards_whose_group_statistics_overflow_float32_are_named_by_group(user_module):
    """3e38 is finite in float32, but two of them sum to inf: the group's mean, so its advantages, would be NaN."""
    import jax.numpy as jnp

    from systolic.workloads.lm.post.grpo_loss import group_advantages

    name = user_module("rewards_large", HOSTILE_REWARDS)
    rewards = Rewards(reward_config(functions=f"{name}:large"))
    scores = rewards.score(["q"] * 4, ["b", "b", "a", "a"], [{}] * 4)
    totals = rewards.total(scores)
    advantages = np.asarray(group_advantages(jnp.asarray(totals), 2, "group"))  # as the rollout computes them
    with pytest.raises(UserError, match=r"group of completions of record p:2 .*past float32's range"):
        rewards.check_groups(totals, advantages, 2, ["p:1", "p:1", "p:2", "p:2"])
    rewards.check_groups(totals[:2], advantages[:2], 2, ["p:1", "p:1"])  # equal small rewards: advantage 0
