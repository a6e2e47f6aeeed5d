"""Held-out accuracy of an lm run on problems with answers: greedy completions of every prompt of a .jsonl file
(`{"prompt": ..., "answer": ...}`, as `systolic data arithmetic` writes test.jsonl) by the serving engine, scored
by reward number_match (lm/post/rewards.py): the completion's final number equals the answer.

    systolic data arithmetic --out data/arith
    systolic train lm --recipe arith-sft data.path=data/arith/sft.jsonl --run-dir runs/arith-sft
    PYTHONPATH=src python benchmarks/arithmetic_accuracy.py runs/arith-sft data/arith/test.jsonl

Prints the accuracy, the problems scored and a few wrong completions; --json prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

def is_correct(completion: str, answer: str) -> bool:
    """Reward number_match's verdict: the completion's final number equals the answer."""
    from systolic.workloads.lm.post.rewards import number_match

    return number_match("", completion, {"answer": answer}, answer_field="answer") == 1.0


def greedy_completions(run_dir: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy completion by the serving engine, ended by the end-of-text id or max_tokens."""
    from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams

    engine = InferenceEngine.from_run(run_dir, max_seqs=64, say=lambda _: None)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), engine.tokenizer.encode(prompt).tolist(), params)
    texts = [""] * len(prompts)
    while engine.has_work():
        for event in engine.step():
            texts[int(event.request_id)] += event.text
    return texts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a finished lm run")
    p.add_argument("problems", type=Path, help=".jsonl of {prompt, answer} records (e.g. test.jsonl)")
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens at most (default 16)")
    p.add_argument("--limit", type=int, default=0, help="score the first N problems only (default 0: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    records = [json.loads(line) for line in args.problems.read_text().splitlines() if line.strip()]
    records = records[:args.limit] if args.limit else records
    start = time.perf_counter()
    completions = greedy_completions(args.run_dir, [r["prompt"] for r in records], args.max_tokens)
    seconds = time.perf_counter() - start
    correct = [is_correct(c, str(r["answer"])) for c, r in zip(completions, records, strict=True)]
    accuracy = sum(correct) / len(records)
    if args.json:
        print(json.dumps({"run": str(args.run_dir), "problems": len(records), "accuracy": accuracy,
                          "seconds": round(seconds, 1)}))
        return
    print(f"{args.run_dir}: greedy accuracy {accuracy:.1%} on {len(records)} problems of {args.problems} "
          f"({seconds:.1f} s)")
    wrong = [(r, c) for r, c, ok in zip(records, completions, correct, strict=True) if not ok]
    for record, completion in wrong[:5]:
        print(f"  {record['prompt'].strip()!r} -> {completion!r} (answer {record['answer']})")


if __name__ == "__main__":
    main()
