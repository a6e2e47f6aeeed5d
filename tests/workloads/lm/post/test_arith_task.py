"""The arithmetic task of `--recipe arith-grpo` in miniature, end to end through the CLI: the imperfect-teacher
pipeline of docs/post_training.md (a clean SFT, then a short fine-tune on a teacher's carry-forgetting answers,
then GRPO with the verifier's reward) on the 100 one-digit additions, with a 64-wide model: 177 s on this 2-core VM
at a load of ~3 (246 s of CPU time).

The full task needs 900 SFT steps before GRPO has something to correct; here the SFT memorises every problem, so
what GRPO must find is the one the real run finds first (docs/post_training.md: the slip "all but disappears in 75
steps"): the carry the model knew before the slipped fine-tune. GRPO's held-out prompts are held out from GRPO, not
from the SFT, which saw every problem."""

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from systolic.cli import main
from systolic.data.arithmetic import make_splits

BENCHMARK = Path(__file__).parents[4] / "benchmarks" / "studies" / "arithmetic_accuracy.py"
ONE_DIGIT = ["--digits", "1", "--ops", "+"]  # 100 problems; the 45 whose sum is 10 or more need a carry
QUIET = ["observe.progress=off", "observe.tensorboard=false", "observe.plot=false", "sample.max_new_tokens=0",
         "checkpoint.async_save=false", "-q"]
# arith-sft's byte-level Llama at half width and 2 layers; rows of 32 bytes hold a problem ("What is 7+5?\n12").
SMALL = ["model.d_model=64", "model.layers=2", "model.max_seq_len=32", "data.seq_len=32", "data.val_percent=1"]


def call(*argv: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    assert code == 0, err.getvalue()


def held_out_accuracy(run: Path) -> dict[int, float]:
    """The GRPO run's eval rows: greedy accuracy (reward number_match) on its held-out prompts, by step."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["reward"] for r in rows if r["split"] == "eval"}


def slipped_answers(runs: list[Path]) -> list[int]:
    """How many of the 45 carry problems each run answers greedily with the teacher's slipped answer."""
    spec = importlib.util.spec_from_file_location("arithmetic_accuracy", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from systolic.workloads.lm.serve.engine import InferenceEngine

    problems = make_splits(digits=1, ops=("+",), train=0, prompts=100, test=0, seed=0).prompts
    carries = [p for p in problems if p.slipped_answer != p.answer]
    counts = []
    for run in runs:
        engine = InferenceEngine.from_run(run, max_seqs=64, say=lambda _: None)
        texts = bench.completions(engine, [p.prompt for p in carries], max_tokens=4)
        counts.append(sum(bench.is_correct(t, p.slipped_answer) for t, p in zip(texts, carries, strict=True)))
    return counts


@pytest.mark.slow
def test_grpo_trains_away_a_teachers_slip_that_sft_taught(tmp_path):
    clean, slips, prompts = (tmp_path / name for name in ("clean", "slips", "prompts"))
    call("data", "arithmetic", "--out", str(clean), *ONE_DIGIT, "--train", "100", "--prompts", "0", "--test", "0")
    call("data", "arithmetic", "--out", str(slips), *ONE_DIGIT, "--train", "100", "--prompts", "0", "--test", "0",
         "--teacher-slips", "0.7")
    call("data", "arithmetic", "--out", str(prompts), *ONE_DIGIT, "--train", "0", "--prompts", "100", "--test", "0")
    sft, slipped, grpo = (tmp_path / name for name in ("sft", "slipped", "grpo"))
    # SFT ONE: the problems with their true answers, memorised (data.val_percent=1 holds out one or two).
    call("train", "lm", "--recipe", "arith-sft", f"data.path={clean / 'sft.jsonl'}", *SMALL, "train.steps=300",
         "train.eval_every=300", *QUIET, "--run-dir", str(sft))
    # SFT TWO: 40 steps on the teacher's records (30 of the 45 carries forgotten), as the recipe's slipped stage.
    call("train", "lm", "--recipe", "sft", f"init.from={sft}", f"data.path={slips / 'sft.jsonl'}", "data.seq_len=32",
         "data.val_percent=1", "train.steps=40", "train.batch_size=32", "optim.lr=1e-3", "optim.warmup_steps=5",
         *QUIET, "--run-dir", str(slipped))
    # GRPO: the recipe at 16 prompts x 8 completions a step, 24 of the 100 prompts held out for the eval rows.
    call("train", "lm", "--recipe", "arith-grpo", f"init.from={slipped}", f"data.path={prompts / 'prompts.jsonl'}",
         "data.val_percent=20", "train.steps=50", "train.eval_every=25", "grpo.max_completion_len=3",
         "checkpoint.every_steps=50", *QUIET, "--run-dir", str(grpo))

    accuracy = held_out_accuracy(grpo)
    before, after = slipped_answers([slipped, grpo])
    # Measured (2026-12-06, this VM): eval rows 0.875, 0.958, 1.0 at steps 0, 25, 50; slipped answers 10 of 45 -> 0
    # (the clean SFT: 0, every problem right). A GRPO that changed nothing (optim.lr=0) keeps both as they were.
    assert accuracy[0] <= 0.9 and before >= 8, (accuracy, before)  # the slipped fine-tune taught the slip
    assert accuracy[50] >= accuracy[0] + 0.08, accuracy  # 2 of the 24 held-out prompts at least
    assert after <= before // 4, (before, after)
