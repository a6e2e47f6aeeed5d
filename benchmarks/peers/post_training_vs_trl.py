"""systolic's post-training against TRL's (the PyTorch library most people use for it) on this CPU: one DPO epoch
and a few GRPO steps of the same tiny model, on the same pairs and prompts, with the same group size and completion
length, timed per optimizer step.

The model is a 4-layer, 256-wide Llama (4 heads, 2 key/value heads, ~3M parameters) made by `transformers` from a
config with its default random initialisation, over a byte-level tokenizer (the 256 bytes and <|endoftext|>, no
merges); systolic imports it with `systolic convert from-hf`. The data are arithmetic problems (`systolic data
arithmetic`'s generator): GRPO's prompts carry their answer and both sides reward a completion 1 when its last
number equals it (number_match); DPO's pairs prefer a sentence with the right answer to one with a wrong answer.

- DPO: the sigmoid loss (beta 0.1), --dpo-batch pairs a step, one epoch over --pairs pairs; the reference's
  log-probabilities are computed in every step (TRL's default; systolic's dpo.reference=live), or with
  --dpo-reference cached before training on both sides (TRL's precompute_ref_log_probs).
- GRPO: --grpo-batch completions a step (--grpo-batch / --group prompts, G = --group completions each) of at most
  --completion-len tokens sampled at temperature 1, rewards, group-normalised advantages, the DAPO loss (both
  sides' default), one update per batch (num_iterations 1), no KL term (beta 0, both sides' default).

Each measurement runs in a fresh process; sides alternate within every round (the order flips each round). A
step's time is the wall time from one optimizer step's end to the next's: TRL's by a callback around each step
(generation included), systolic's by the arrival of each train row in metrics.jsonl (observe.log_every=1). The
first step of each measurement (compilation, warm-up) is left out; the table shows the median over the others and
all rounds.

    PYTHONPATH=src python benchmarks/peers/post_training_vs_trl.py                 # about 5-10 minutes on 2 cores
    PYTHONPATH=src python benchmarks/peers/post_training_vs_trl.py --only trl --rounds 1
    PYTHONPATH=src python benchmarks/peers/post_training_vs_trl.py --tasks grpo --grpo-steps 6 --completion-len 64

Needs TRL (pip install trl, which brings transformers, datasets and accelerate) and torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS, WIDTH, HEADS, KV_HEADS, MLP = 4, 256, 4, 2, 704
CONTEXT = 512
EOT = "<|endoftext|>"
SIDES = ("systolic", "trl")
TASKS = ("dpo", "grpo")
DPO_BETA = 0.1
# No hub look-ups (there is no network here), no tokenizer thread pool beside the trainer's.
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
LR = 1e-6  # the time of a step does not depend on it; small, so the model (and completion lengths) barely move


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS), help=f"which (default {','.join(TASKS)})")
    p.add_argument("--only", choices=SIDES, help="run one side alone")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    p.add_argument("--pairs", type=int, default=64, help="DPO pairs: one epoch (default 64)")
    p.add_argument("--dpo-batch", type=int, default=8, help="DPO pairs a step (default 8)")
    p.add_argument("--dpo-reference", choices=("live", "cached"), default="live",
                   help="the reference's log-probabilities: in every step (default) or once before training")
    p.add_argument("--group", type=int, default=8, help="GRPO completions per prompt, G (default 8)")
    p.add_argument("--grpo-batch", type=int, default=64, help="GRPO completions a step (default 64)")
    p.add_argument("--completion-len", type=int, default=32, help="GRPO completion tokens at most (default 32)")
    p.add_argument("--grpo-steps", type=int, default=4, help="GRPO steps per measurement, the first untimed "
                   "(default 4)")
    p.add_argument("--keep", type=Path, help="write the model, data and runs here and keep them (default: a temp dir)")
    p.add_argument("--worker", nargs=3, metavar=("SIDE", "TASK", "ROOT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tasks = tuple(t.strip() for t in args.tasks.split(","))
    if not set(args.tasks) <= set(TASKS) or args.rounds < 1 or args.grpo_steps < 2 or args.pairs < 2 * args.dpo_batch \
            or args.grpo_batch % args.group:
        p.error(f"--tasks from {TASKS}; --rounds >= 1; --grpo-steps >= 2; --pairs at least two batches; "
                "--grpo-batch a multiple of --group")
    return args


# THE MODEL AND THE DATA ---------------------------------------------------------------------------------------


def make_model(root: Path) -> tuple[Path, Path]:
    """(the Hugging Face folder, the systolic run imported from it)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf, run = root / "hf", root / "run"
    for folder in (hf, run):  # an earlier --keep run's
        shutil.rmtree(folder, ignore_errors=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 characters, one per byte
    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([EOT])
    eot = bpe.token_to_id(EOT)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOT, bos_token=EOT, pad_token=EOT)
    fast.save_pretrained(hf)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=bpe.get_vocab_size(), hidden_size=WIDTH, intermediate_size=MLP, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-6, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, tie_word_embeddings=False,
        dtype="float32")
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    _check([sys.executable, "-m", "systolic", "convert", "from-hf", str(hf), str(run)], "systolic convert from-hf")
    return hf, run


def make_data(root: Path, args: argparse.Namespace) -> None:
    """root/pairs.jsonl (prompt, chosen, rejected) and root/prompts.jsonl (prompt, answer)."""
    from systolic.data.arithmetic import make_splits

    n_prompts = args.grpo_batch // args.group * args.grpo_steps
    splits = make_splits(digits=3, ops=("+", "-"), train=args.pairs, prompts=n_prompts, test=0, seed=0)

    def sentence(p, answer: int) -> str:
        return f"{p.a} {p.op} {p.b}: work it out digit by digit; the result is {answer}."

    pairs = [{"prompt": p.prompt, "chosen": sentence(p, int(p.answer)), "rejected": sentence(p, int(p.answer) + 1)}
             for p in splits.sft]
    prompts = [{"prompt": p.prompt, "answer": p.answer} for p in splits.prompts]
    for name, records in (("pairs.jsonl", pairs), ("prompts.jsonl", prompts)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in records))


# TRL ----------------------------------------------------------------------------------------------------------


def trl_worker(task: str, root: Path, args: argparse.Namespace) -> list[float]:
    """TRL's trainer of `task` on the model and data in `root`; each optimizer step's wall time (s)."""
    import datasets
    import transformers
    import trl

    times: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.start)

    common = dict(output_dir=str(root / f"trl-{task}"), use_cpu=True, report_to="none", save_strategy="no",
                  logging_strategy="no", disable_tqdm=True, learning_rate=LR, seed=0, dataloader_num_workers=0,
                  gradient_checkpointing=False)  # TRL's configs turn it on: a second forward pass, for memory
                                                 # that a tiny model does not need (systolic: model.remat=none)
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "hf")
    records = [json.loads(line) for line in (root / f"{'pairs' if task == 'dpo' else 'prompts'}.jsonl").open()]
    data = datasets.Dataset.from_list(records)
    if task == "dpo":
        config = trl.DPOConfig(**common, per_device_train_batch_size=args.dpo_batch, num_train_epochs=1,
                               beta=DPO_BETA, loss_type=["sigmoid"],
                               precompute_ref_log_probs=args.dpo_reference == "cached")
        trainer = trl.DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                                 callbacks=[StepClock()])
    else:
        from systolic.workloads.lm.post.rewards import number_match  # the very function systolic's side scores with

        def reward(prompts, completions, answer, **_):
            return [number_match(p, c, {"answer": a}, answer_field="answer")
                    for p, c, a in zip(prompts, completions, answer, strict=True)]

        config = trl.GRPOConfig(**common, per_device_train_batch_size=args.grpo_batch, num_generations=args.group,
                                max_completion_length=args.completion_len, max_steps=args.grpo_steps, temperature=1.0,
                                top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, num_iterations=1, loss_type="dapo",
                                scale_rewards="group")
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                                  processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    return times


# SYSTOLIC -----------------------------------------------------------------------------------------------------


def systolic_worker(task: str, root: Path, args: argparse.Namespace) -> list[float]:
    """`systolic train lm --recipe {dpo,grpo}` from the imported run; each optimizer step's wall time (s), from
    the moments its train rows reach metrics.jsonl (one row a step)."""
    run_dir = root / f"systolic-{task}"
    shutil.rmtree(run_dir, ignore_errors=True)
    if task == "dpo":
        steps = args.pairs // args.dpo_batch
        # One pair a row, so that a step's rows are --dpo-batch pairs as TRL's batch is: a row holds two sequences of
        # at most (seq_len + 1) // 2 tokens (one token a byte here, and the end-of-text id), and not two pairs.
        pairs = [json.loads(line) for line in (root / "pairs.jsonl").open()]
        longest = max(len(p["prompt"].encode()) + len(p[side].encode()) + 1
                      for p in pairs for side in ("chosen", "rejected"))
        overrides = [f"data.path={root / 'pairs.jsonl'}", f"data.seq_len={2 * longest}",
                     f"train.batch_size={args.dpo_batch}",
                     f"dpo.beta={DPO_BETA}", "dpo.loss=sigmoid", f"dpo.reference={args.dpo_reference}"]
    else:
        steps = args.grpo_steps
        overrides = [f"data.path={root / 'prompts.jsonl'}", f"data.seq_len={args.completion_len + 32}",
                     f"train.batch_size={args.grpo_batch}",
                     f"grpo.group_size={args.group}", f"grpo.max_completion_len={args.completion_len}",
                     "grpo.temperature=1.0", "grpo.top_p=1.0", "grpo.top_k=0", "grpo.beta=0", "grpo.clip_eps=0.2",
                     "grpo.num_iterations=1", "grpo.loss=dapo", "grpo.scale_rewards=group",
                     "reward.functions=number_match"]
    command = [sys.executable, "-m", "systolic", "train", "lm", "--recipe", task, f"init.from={root / 'run'}",
               *overrides, f"train.steps={steps}", f"train.eval_every={steps + 1}", f"optim.lr={LR}",
               "optim.warmup_steps=0", f"checkpoint.every_steps={steps + 1}", "observe.log_every=1",
               "observe.tensorboard=false", "observe.plot=false", "sample.max_new_tokens=0", "--run-dir",
               str(run_dir), "-q"]
    arrivals = _row_arrivals(command, run_dir / "metrics.jsonl")
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def _row_arrivals(command: list[str], metrics: Path) -> list[float]:
    """Runs `command`, noting when it starts and when each new train row appears in `metrics` (polled every 2 ms)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    arrivals = [time.perf_counter()]  # so the first "step" is start-up, compilation and step 1, left out as TRL's is
    seen = 0
    while True:
        done = proc.poll() is not None
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        train = [r for r in rows if r.get("split") == "train" and r.get("step", 0) > 0]
        now = time.perf_counter()
        arrivals += [now] * (len(train) - seen)
        seen = len(train)
        if done:
            break
        time.sleep(0.002)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout.read()[-4000:]}")
    return arrivals


# THE COMPARISON -----------------------------------------------------------------------------------------------


def measure(side: str, task: str, root: Path, args: argparse.Namespace) -> list[float]:
    """One measurement in a fresh process: step times in seconds, the first step left out."""
    argv = [sys.executable, __file__, "--worker", side, task, str(root), *_passed_settings(args)]
    out = _check(argv, f"{side} {task}")
    times = json.loads(out.strip().splitlines()[-1])
    return times[1:]


def _passed_settings(args: argparse.Namespace) -> list[str]:
    return [f"--pairs={args.pairs}", f"--dpo-batch={args.dpo_batch}", f"--dpo-reference={args.dpo_reference}",
            f"--group={args.group}", f"--grpo-batch={args.grpo_batch}", f"--completion-len={args.completion_len}",
            f"--grpo-steps={args.grpo_steps}"]


def _check(argv: list[str], what: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **QUIET_ENV})
    if proc.returncode:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc.stdout


def main(argv=None) -> int:
    args = _args(argv)
    if args.worker:
        side, task, root = args.worker
        worker = systolic_worker if side == "systolic" else trl_worker
        print(json.dumps(worker(task, Path(root), args)))
        return 0
    sides = (args.only,) if args.only else SIDES
    root = args.keep or Path(tempfile.mkdtemp(prefix="post-vs-trl-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        make_model(root)
        make_data(root, args)
        times = {(s, t): [] for s in sides for t in args.tasks}
        for r in range(args.rounds):
            for task in args.tasks:
                for side in sides if r % 2 == 0 else sides[::-1]:
                    times[side, task] += measure(side, task, root, args)
                    print(f"round {r + 1} {task} {side}: median {statistics.median(times[side, task]) * 1e3:.0f} ms",
                          file=sys.stderr)
        print(_table(times, sides, args))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def _table(times: dict, sides: tuple[str, ...], args: argparse.Namespace) -> str:
    what = {"dpo": f"DPO step ({args.dpo_batch} pairs, reference {args.dpo_reference})",
            "grpo": f"GRPO step ({args.grpo_batch // args.group} prompts x G={args.group}, <= {args.completion_len} "
                    "tokens)"}
    lines = [f"{'task':<46} " + " ".join(f"{s + ' ms':>12}" for s in sides) + ("  trl / systolic" if len(sides) > 1
                                                                                else "")]
    for task in args.tasks:
        medians = {s: statistics.median(times[s, task]) for s in sides}
        ratio = f"  {medians['trl'] / medians['systolic']:.2f}x" if len(sides) > 1 else ""
        lines.append(f"{what[task]:<46} " + " ".join(f"{medians[s] * 1e3:>12.0f}" for s in sides) + ratio)
    counts = ", ".join(f"{s} {t}: {len(times[s, t])}" for s in sides for t in args.tasks)
    return "\n".join([*lines, f"(median of the timed steps over {args.rounds} round(s): {counts})"])


if __name__ == "__main__":
    sys.exit(main())
