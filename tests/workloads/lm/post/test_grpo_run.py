"""`systolic train lm --recipe grpo` end to end on a tiny base run: its rows, an exact resume from a checkpoint in the
middle of a rollout's updates, and bad rewards and prompts stopping the run with one paragraph and exit 2."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from tiny import LM_CLI_QUIET, TINY_LM, call

from systolic.workloads.lm.loaded_run import load_run


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """TINY_LM trained 2 steps: the policy GRPO starts from (random enough to write digits now and then)."""
    run = tmp_path_factory.mktemp("grpo") / "base"
    assert call("train", "lm", *TINY_LM, *LM_CLI_QUIET, "train.steps=2", "-q", "--run-dir", str(run))[0] == 0
    return run


def write_prompts(path: Path, records: list[dict] | None = None) -> Path:
    rng = np.random.default_rng(0)
    if records is None:
        records = [{"prompt": f"{a}+{b}=", "answer": int(a + b)} for a, b in rng.integers(0, 10, (40, 2))]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def grpo_args(base: Path, data: Path, run: Path, *extra: str) -> list[str]:
    """4 prompts x 4 completions of up to 6 tokens a step; a format reward that a random policy sometimes earns
    (a digit anywhere), so groups have spread and the loss has gradients."""
    return ["train", "lm", "--recipe", "grpo", f"init.from={base}", f"data.path={data}", "data.seq_len=16",
            "data.val_percent=20", "grpo.max_completion_len=6", "grpo.group_size=4", "train.batch_size=16",
            "train.eval_batches=1", "reward.functions=number_match,format", "reward.format_pattern='[0-9]'",
            "reward.weights=1,0.5", "optim.lr=1e-3", "checkpoint.every_steps=2", "checkpoint.async_save=false",
            "observe.progress=off", "observe.tensorboard=false", "observe.plot=false", "-q", *extra,
            "--run-dir", str(run)]


def rows(run: Path, split: str) -> dict[int, dict]:
    found = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_per_s")}
            for r in found if r["split"] == split}


@pytest.mark.slow
def test_grpo_trains_writes_trls_metrics_and_resumes_exactly_mid_rollout(base, tmp_path):
    """4 steps, each rollout trained on twice, with the KL term (the reference: init.from's weights); stopped at
    step 3, the first update of the second rollout, and resumed: the same rows and the same weights."""
    data = write_prompts(tmp_path / "p.jsonl")
    common = ["train.steps=4", "train.eval_every=2", "grpo.num_iterations=2", "grpo.beta=0.04"]
    assert call(*grpo_args(base, data, tmp_path / "whole", *common))[0] == 0
    train, evals = rows(tmp_path / "whole", "train"), rows(tmp_path / "whole", "eval")
    assert sorted(train) == [1, 2, 3, 4] and sorted(evals) == [0, 2, 4]
    assert {"reward", "rewards/number_match/mean", "rewards/format/std", "frac_reward_zero_std", "kl",
            "clip_ratio/region_mean", "completions/mean_length", "completions/max_length"} <= set(train[1])
    timed = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    timed = {r["step"]: r for r in timed if r["split"] == "train"}
    assert timed[1]["time/rollout_s"] > 0 and timed[2]["time/rollout_s"] == 0 and timed[3]["time/rollout_s"] > 0
    assert all(timed[s]["time/update_s"] > 0 for s in timed)
    assert set(evals[0]) == {"step", "split", "reward", "rewards/number_match/mean", "rewards/format/mean",
                             "completions/mean_length"}
    # A rollout serves two steps: the same rewards; the first update's importance ratio is 1 (nothing clipped).
    assert train[1]["reward"] == train[2]["reward"] and train[1]["clip_ratio/region_mean"] == 0.0
    assert any(train[s]["loss"] != 0.0 for s in train)

    resumed = grpo_args(base, data, tmp_path / "resumed", *common)
    assert call(*resumed, "loop.stop_at_step=3")[0] == 0
    assert call(*resumed)[0] == 0
    assert rows(tmp_path / "resumed", "train") == train and rows(tmp_path / "resumed", "eval") == evals
    whole, again = (load_run(tmp_path / name, "test").params for name in ("whole", "resumed"))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), whole, again))


@pytest.mark.slow
def test_a_reward_function_that_fails_stops_the_run_before_its_first_step(base, tmp_path, monkeypatch):
    """A user's function that raises, returns NaN, or would take the run down (issue 45: never returns, exits,
    crashes its interpreter, returns what float32 cannot hold, raises a BaseException, exits at import): one
    paragraph naming the function (and the record, once one is scored), exit 2, and no run directory left."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(
        "import ctypes, os, sys, time\n\n"
        "class Escape(BaseException):\n    pass\n\n"
        "def broken(prompt, completion, fields):\n    raise KeyError('score')\n\n"
        "def nan(prompt, completion, fields):\n    return float('nan')\n\n"
        "def hangs(prompt, completion, fields):\n    time.sleep(3600)\n\n"
        "def exits(prompt, completion, fields):\n    sys.exit(0)\n\n"
        "def hard_exit(prompt, completion, fields):\n    os._exit(1)\n\n"
        "def segfault(prompt, completion, fields):\n    ctypes.string_at(0)\n\n"
        "def huge_int(prompt, completion, fields):\n    return 10**400\n\n"
        "def past_float32(prompt, completion, fields):\n    return 1e300\n\n"
        "def escapes(prompt, completion, fields):\n    raise Escape('out')\n")
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    data = write_prompts(tmp_path / "p.jsonl")
    before = (data.read_bytes(), (tmp_path / "my_rewards.py").read_bytes())
    for spec, message in (("my_rewards:broken", "raised KeyError"), ("my_rewards:nan", "returned nan"),
                          ("my_rewards:hangs", "did not answer within 2 s"), ("my_rewards:exits", "raised SystemExit"),
                          ("my_rewards:hard_exit", "(exit status 1)"), ("my_rewards:segfault", "signal SIGSEGV"),
                          ("my_rewards:huge_int", "(401 digits)"), ("my_rewards:past_float32", "past float32's range"),
                          ("my_rewards:escapes", "raised Escape: out"),
                          ("exits_at_import:f", "importing exits_at_import failed (SystemExit: 0)")):
        run = tmp_path / spec.replace(":", "-")
        code, _, err = call(*grpo_args(base, data, run, "train.steps=2", f"reward.functions={spec}",
                                       "reward.weights=", "reward.format_pattern=", "reward.timeout_s=2"))
        assert code == 2 and message in err and spec.split(":")[1] in err and "Fix:" in err, err
        if "import" not in spec:
            assert "p.jsonl:" in err, err
        assert not run.exists(), spec
    assert (data.read_bytes(), (tmp_path / "my_rewards.py").read_bytes()) == before


@pytest.mark.slow  # the base run's time; the records' checks alone: test_grpo.py
def test_a_bad_prompt_file_stops_before_anything_is_written(base, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": 2}, {"question": "1+2="}])
    code, _, err = call(*grpo_args(base, data, tmp_path / "run", "train.steps=2"))
    assert code == 2 and f"{data} line 2 has neither `prompt` nor `messages`" in err and "Fix:" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # the base run's time
def test_identical_completions_warn_once_and_the_progress_line_carries_the_zero_std_share(base, tmp_path):
    """Sampling at temperature 1e-6 (greedy in effect) writes each group's completions alike, so every group earns
    one reward: one warning with the fix, frac_reward_zero_std on every progress line, the first-step line counting
    the rollout before it, and rows sized from the prompts (4 tokens) and completions (6), not data.seq_len=32."""
    data = write_prompts(tmp_path / "p.jsonl")
    args = [a for a in grpo_args(base, data, tmp_path / "run", "train.steps=2", "grpo.temperature=1e-6",
                                 "data.seq_len=32") if a != "-q"]
    code, out, err = call(*args)
    assert code == 0, err
    assert out.count("warning: in the rollout for step 1, 100% of the 4 groups earned one reward") == 1, out
    assert "identical completions" in out and "Fix: more varied completions (raise grpo.temperature, now 1e-06" in out
    assert "update rows of 16 tokens" in out, out
    assert "step 1/2 |" in err and "step 2/2 |" in err and err.count("frac_reward_zero_std 100%") == 2, err
    assert "the rollout it trained on took" in err, err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["frac_reward_zero_std"] == 1.0 for r in rows if r["split"] == "train")
