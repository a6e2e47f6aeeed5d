"""Held-out accuracy of an lm run on problems with answers: greedy completions of every prompt of a .jsonl file
(`{"prompt": ..., "answer": ...}`, as `systolic data arithmetic` writes test.jsonl) by the serving engine, scored
by reward number_match (lm/post/rewards.py): the completion's final number equals the answer.

    systolic data arithmetic --out data/arith
    systolic train lm --recipe arith-sft data.path=data/arith/sft.jsonl --run-dir runs/arith-sft
    PYTHONPATH=src python benchmarks/studies/arithmetic_accuracy.py runs/arith-sft data/arith/test.jsonl

Prints the accuracy, the problems scored and a few wrong completions; --json prints one JSON object instead.
--samples K also samples K completions of each prompt at --temperature (default 1) and reports pass@K (the share of
problems that at least one of them answers right) and the mean accuracy of a sample: what RL with this verifier can
reach by sharpening what sampling already finds.
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


def completions(engine, prompts: list[str], max_tokens: int, temperature: float = 0.0) -> list[str]:
    """Each prompt's completion by the serving engine (greedy at temperature 0; else seeded by its index), ended by
    the end-of-text id or max_tokens."""
    from systolic.workloads.lm.serve.engine import SamplingParams

    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i if temperature else None)
        engine.add_request(str(i), engine.tokenizer.encode(prompt).tolist(), params)
    texts = [""] * len(prompts)
    while engine.has_work():
        for event in engine.step():
            texts[int(event.request_id)] += event.text
    return texts


def sampled_scores(engine, records: list[dict], k: int, temperature: float, max_tokens: int) -> dict[str, float]:
    """pass@k and the mean accuracy of one sample, from k samples of every prompt."""
    texts = completions(engine, [r["prompt"] for r in records for _ in range(k)], max_tokens, temperature)
    right = [is_correct(text, str(records[i // k]["answer"])) for i, text in enumerate(texts)]
    per_problem = [right[i * k:(i + 1) * k] for i in range(len(records))]
    return {f"pass@{k}": sum(map(any, per_problem)) / len(records), "sample_accuracy": sum(right) / len(right)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a finished lm run")
    p.add_argument("problems", type=Path, help=".jsonl of {prompt, answer} records (e.g. test.jsonl)")
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens at most (default 16)")
    p.add_argument("--limit", type=int, default=0, help="score the first N problems only (default 0: all)")
    p.add_argument("--samples", type=int, default=0, help="also K samples a prompt: pass@K (default 0: greedy only)")
    p.add_argument("--temperature", type=float, default=1.0, help="the samples' temperature (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    records = [json.loads(line) for line in args.problems.read_text().splitlines() if line.strip()]
    records = records[:args.limit] if args.limit else records
    from systolic.workloads.lm.serve.engine import InferenceEngine

    start = time.perf_counter()
    engine = InferenceEngine.from_run(args.run_dir, max_seqs=64, say=lambda _: None)
    greedy = completions(engine, [r["prompt"] for r in records], args.max_tokens)
    correct = [is_correct(c, str(r["answer"])) for c, r in zip(greedy, records, strict=True)]
    accuracy = sum(correct) / len(records)
    sampled = sampled_scores(engine, records, args.samples, args.temperature, args.max_tokens) if args.samples else {}
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"run": str(args.run_dir), "problems": len(records), "accuracy": accuracy, **sampled,
                          "seconds": round(seconds, 1)}))
        return
    print(f"{args.run_dir}: greedy accuracy {accuracy:.1%} on {len(records)} problems of {args.problems} "
          f"({seconds:.1f} s)")
    if sampled:
        print(f"  {args.samples} samples a problem at temperature {args.temperature}: pass@{args.samples} "
              f"{sampled[f'pass@{args.samples}']:.1%}, one sample right {sampled['sample_accuracy']:.1%}")
    wrong = [(r, c) for r, c, ok in zip(records, greedy, correct, strict=True) if not ok]
    for record, completion in wrong[:5]:
        print(f"  {record['prompt'].strip()!r} -> {completion!r} (answer {record['answer']})")


if __name__ == "__main__":
    main()
