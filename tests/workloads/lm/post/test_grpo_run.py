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
    """A user's function that raises or returns NaN: one paragraph naming the function and the record, exit 2,
    and no checkpoint."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(
        "def broken(prompt, completion, fields):\n    raise KeyError('score')\n\n"
        "def nan(prompt, completion, fields):\n    return float('nan')\n")
    data = write_prompts(tmp_path / "p.jsonl")
    for function, message in (("broken", "raised KeyError"), ("nan", "returned nan")):
        run = tmp_path / function
        code, _, err = call(*grpo_args(base, data, run, "train.steps=2", f"reward.functions=my_rewards:{function}",
                                       "reward.weights=", "reward.format_pattern="))
        assert code == 2 and message in err and function in err and "p.jsonl:" in err and "Fix:" in err, err
        assert not list((run / "checkpoints").glob("[0-9]*")), function


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
