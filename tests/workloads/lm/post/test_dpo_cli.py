"""`systolic train lm --recipe dpo` end to end on the shared tiny config: a tiny base run, then DPO from it with TRL's
metric names in the rows, an exact resume from its checkpoint, and bad pairs refused in one paragraph with exit 2
and nothing written."""

import json
from pathlib import Path

import pytest

from tiny import LM_CLI_QUIET, TINY_LM, call


TRL_NAMES = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "logits/chosen", "logits/rejected"}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A 2-step TINY_LM run on bytes: the model DPO starts from."""
    run = tmp_path_factory.mktemp("dpo-cli") / "base"
    assert call("train", "lm", *TINY_LM, *LM_CLI_QUIET, "train.steps=2", "-q", "--run-dir", str(run))[0] == 0
    return run


def sums(n: int) -> list[dict]:
    return [{"prompt": f"{i}+{i}=", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"} for i in range(n)]


def dpo_args(base: Path, pairs: Path, run: Path) -> list[str]:
    """Rows of 33 bytes (each sequence at most 16), 6 steps at a rate that moves a tiny model."""
    return ["train", "lm", "--recipe", "dpo", *TINY_LM, f"init.from={base}", f"data.path={pairs}", "data.seq_len=32",
            "train.steps=6", "train.eval_every=3", "optim.lr=1e-2", "checkpoint.every_steps=3", "observe.log_every=1",
            "observe.progress=off", "sample.max_new_tokens=0", "observe.tensorboard=false", "observe.plot=false",
            "--run-dir", str(run)]


def rows(run: Path, split: str) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["split"] == split}


@pytest.mark.slow
def test_dpo_run_writes_trl_metrics_and_resumes_exactly(base, tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", sums(40))
    code, out, err = call(*dpo_args(base, pairs, tmp_path / "whole"))
    assert code == 0, err
    assert "preference pairs" in out and "preference accuracy" in out, out
    # 5% of 40 pairs is 2: topped up to a fifth of them (the minimum of 50 where the data allows), and said so.
    assert "32 train / 8 validation preference pairs (held out by name: data.val_percent, topped up to 50" in out, out
    train, evals = rows(tmp_path / "whole", "train"), rows(tmp_path / "whole", "eval")
    assert TRL_NAMES <= set(train[1]) and sorted(evals) == [3, 6]
    assert set(evals[3]) == {"step", "split", "loss", "rewards/accuracies", "rewards/margins"}
    assert train[1]["rewards/margins"] == 0.0, "the policy starts as the reference"
    assert train[6]["loss"] < train[1]["loss"] and evals[6]["rewards/margins"] > 0

    stopped = dpo_args(base, pairs, tmp_path / "resumed")
    assert call(*stopped, "loop.stop_at_step=3")[0] == 0
    assert max(rows(tmp_path / "resumed", "train")) == 3
    assert call(*stopped)[0] == 0
    for split in ("train", "eval"):
        whole, resumed = rows(tmp_path / "whole", split), rows(tmp_path / "resumed", split)
        for step in whole:
            assert {k: v for k, v in resumed[step].items() if k != "tokens_per_s"} == {
                k: v for k, v in whole[step].items() if k != "tokens_per_s"}, (split, step)


@pytest.mark.slow
def test_bad_pairs_are_one_paragraph_exit_2_and_leave_nothing(base, tmp_path):
    good = sums(4)
    cases = [
        ([*good, "not json"], "line 5 is not valid JSON"),
        ([*good, {"prompt": "a", "chosen": "b"}], "line 5 has no `rejected` field"),
        ([*good, {"prompt": "a", "chosen": "", "rejected": "c"}], "line 5 has an empty `chosen`"),
        ([*good, {"prompt": "a", "chosen": 3, "rejected": "c"}], "line 5 has a `chosen` that is a JSON number (3)"),
        ([*good, {"prompt": 3, "chosen": "b", "rejected": "c"}], "line 5 has a `prompt` that is neither"),
        ([*good, {"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}],
         "line 5 has a `chosen` that is neither"),
        ([*good, {"prompt": "a\ud800", "chosen": "b", "rejected": "c"}],
         "line 5: The text to tokenize is not Unicode text"),
        ([*good, [1, 2]], "line 5 holds a JSON list, not an object"),
        ([*good[:1]], "holds 1 usable preference pair(s)"),
    ]
    for i, (records, message) in enumerate(cases):
        path = write_jsonl(tmp_path / f"case{i}.jsonl", records)
        run = tmp_path / f"run{i}"
        code, _, err = call(*dpo_args(base, path, run), "-q")
        assert code == 2 and message in err and "Fix:" in err, (message, err)
        assert not run.exists(), "nothing written"
    code, _, err = call(*dpo_args(base, tmp_path / "case0.jsonl", tmp_path / "runx"), "data.max_bytes=100", "-q")
    assert code == 2 and "objective=dpo reads preference pairs from data.path" in err
