"""Training start-up and memory against corpus size, and the loader's speed: what a prepared corpus costs a run.

    PYTHONPATH=src python benchmarks/studies/data_startup.py --small data/small --large data/large --rounds 3

For each prepared folder (`systolic data prepare`), `--rounds` times, alternating which goes first: a fresh
`systolic train lm` process (the default model, 3 steps, the folder's own tokenizer or bytes, the compile cache warmed by an
untimed first run) is timed from process start to the end of its first step (the "first step" line), and its peak
RSS is read from wait4. Then the loader alone: `text.make_train_iterator` over each folder's memory-mapped
training split, one process's share of a global batch, tokens per second over `--batches` batches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 3


def start_up(folder: Path, run_dir: Path, extra: list[str]) -> tuple[float, float, float]:
    """(seconds to the end of the first step, peak RSS MB, steady tokens/s) of one `systolic train lm` process."""
    tokenizer = json.loads((folder / "index.json").read_text())["tokenizer"]["file"]
    cmd = [sys.executable, "-m", "systolic", "train", "lm", f"data.path={folder}",
           f"data.tokenizer={folder if tokenizer else 'byte'}",
           f"train.steps={STEPS}", "train.eval_batches=1", "observe.log_every=1", "observe.plot=false",
           *extra, "--run-dir", str(run_dir)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"),
                                     COLUMNS="200"))
    first = None
    out = []
    for line in proc.stdout:
        out.append(line)
        if first is None and "first step (compile + run) took" in line:
            first = time.perf_counter() - start
    _, status, usage = os.wait4(proc.pid, 0)
    if status or first is None:
        sys.exit(f"failed (status {status}): {' '.join(cmd)}\n{''.join(out)}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return first, usage.ru_maxrss / 1024, _tokens_per_s(rows)


def _tokens_per_s(rows: list[dict]) -> float:
    """The last logged window's tokens/s (the loop's steady-state rate: the compiling first step is excluded)."""
    rates = [r["tokens_per_s"] for r in rows if r.get("split") == "train" and "tokens_per_s" in r]
    return rates[-1] if rates else float("nan")


def loader_tokens_per_s(folder: Path, seq_len: int, global_batch: int, processes: int, batches: int) -> float:
    from systolic.data.prepared import PreparedDataset
    from systolic.data.text import make_train_iterator

    tokens = PreparedDataset.open(folder, verify=False).tokens("train")
    it = make_train_iterator(tokens, seq_len=seq_len, global_batch=global_batch, seed=0, process_count=processes)
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * global_batch // processes * seq_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=Path, required=True)
    parser.add_argument("--large", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("extra", nargs="*", help="more config overrides for the training runs")
    args = parser.parse_args()
    from systolic.data.prepared import PreparedDataset

    folders = {"small": args.small, "large": args.large}
    for name, folder in folders.items():
        ix = PreparedDataset.open(folder, verify=False).index
        shard_bytes = sum(s["tokens"] for split in ix["splits"].values() for s in split["shards"]) * \
            __import__("numpy").dtype(ix["dtype"]).itemsize
        print(f"{name}: {folder}, {ix['splits']['train']['tokens']:,} training tokens, {shard_bytes / 1e9:.2f} GB of shards")
    with tempfile.TemporaryDirectory() as tmp:
        for folder in folders.values():  # warm the compile cache (and the shards' verification record)
            start_up(folder, Path(tmp) / f"warm-{folder.name}", args.extra)
        print("| round | corpus | start-up s | peak RSS MB | train tok/s |\n|---|---|---|---|---|")
        for r in range(args.rounds):
            for name in (("small", "large") if r % 2 == 0 else ("large", "small")):
                first, rss, tps = start_up(folders[name], Path(tmp) / f"{name}{r}", args.extra)
                print(f"| {r + 1} | {name} | {first:.2f} | {rss:.0f} | {tps:,.0f} |", flush=True)
    print("| corpus | loader tok/s, 1 of 1 process | 1 of 8 processes |\n|---|---|---|")
    for name, folder in folders.items():
        one = loader_tokens_per_s(folder, 1024, 64, 1, args.batches)
        eighth = loader_tokens_per_s(folder, 1024, 64, 8, args.batches)
        print(f"| {name} | {one:,.0f} | {eighth:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
