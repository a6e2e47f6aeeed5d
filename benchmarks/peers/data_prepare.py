"""`systolic data prepare` against Hugging Face `datasets` on the same corpus and tokenizer: MB of text per second.

    PYTHONPATH=src python benchmarks/peers/data_prepare.py --copies 8              # 252 MB of .py, byte-level
    PYTHONPATH=src python benchmarks/peers/data_prepare.py --copies 32 --tokenizer tok.json \
        --hf-python /tmp/dsvenv/bin/python

The corpus is the standard library's UTF-8 `.py` files hard-linked `--copies` times under different folder names
(the names differ, so the train/validation split differs per copy; the text repeats, which neither tool exploits).
Each side runs in its own process, `--rounds` times, alternating which goes first (times on a shared machine drift):
systolic: stream, tokenize in `--workers` processes, write uint16 shards and the index. `datasets` (only with
--hf-python, a Python that has it; it is not a systolic dependency): `load_dataset("text", sample_by="document")`,
`map(batched=True, num_proc=workers)` with the same tokenizer.json, `save_to_disk` (Arrow). Both times include
reading and writing; both start with an empty output folder and a warm page cache. Peak RSS is the largest single
process of the side (its workers included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def make_corpus(root: Path, copies: int) -> int:
    """Hard links of the standard library's UTF-8 .py files, `copies` times; returns the total bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(stdlib.rglob("*.py"))
             if f.relative_to(stdlib).parts[0] not in ("site-packages", "dist-packages") and _is_utf8(f)]
    total = 0  # a few test modules are Latin-1: `datasets` cannot read them, so neither tool gets them
    for i in range(copies):
        for file in files:
            dst = root / f"copy{i}" / file.relative_to(stdlib)
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(file, dst)
            except OSError:
                shutil.copyfile(file, dst)
            total += file.stat().st_size
    return total


def _is_utf8(file: Path) -> bool:
    try:
        file.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def side_systolic(corpus: Path, out: Path, tokenizer: str, workers: int) -> None:
    from systolic.data.prepare import prepare

    print(prepare(str(corpus), out, tokenizer=tokenizer, workers=workers), file=sys.stderr)


def side_datasets(corpus: Path, out: Path, tokenizer: str, workers: int) -> None:
    import datasets
    from tokenizers import Tokenizer

    files = sorted(str(p) for p in corpus.rglob("*.py"))
    tok = Tokenizer.from_file(tokenizer)

    def encode(batch):
        return {"ids": [e.ids for e in tok.encode_batch(batch["text"])]}

    ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                               cache_dir=str(out.parent / f"{out.name}-hf-cache"))
    ds.map(encode, batched=True, num_proc=workers, remove_columns=["text"]).save_to_disk(str(out))


def timed(python: str, side: str, corpus: Path, out: Path, tokenizer: str, workers: int) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of one side in a fresh process; its outputs are removed afterwards."""
    cmd = [python, __file__, "--side", side, "--corpus", str(corpus), "--out", str(out), "--tokenizer", tokenizer,
           "--workers", str(workers)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src")))
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if status:
        sys.exit(f"{side} failed (status {status}): {' '.join(cmd)}")
    rss = json.loads(Path(f"{out}.rss").read_text())["children_max_kb"]
    for path in (out, Path(f"{out}.rss"), out.parent / f"{out.name}-hf-cache"):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return seconds, max(usage.ru_maxrss, rss) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json (needed for datasets)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hf-python", default="", help="a Python with `datasets` installed: also time it")
    parser.add_argument("--side", choices=("systolic", "datasets"), help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # one side, in its own process
        (side_systolic if args.side == "systolic" else side_datasets)(args.corpus, args.out, args.tokenizer, args.workers)
        kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the worker processes
        Path(f"{args.out}.rss").write_text(json.dumps({"children_max_kb": kb}))
        return
    sides = [("systolic", sys.executable)] + ([("datasets", args.hf_python)] if args.hf_python else [])
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        mb = make_corpus(tmp / "corpus", args.copies) / 1e6
        print(f"corpus: {mb:.1f} MB in {sum(1 for _ in (tmp / 'corpus').rglob('*.py')):,} files; tokenizer "
              f"{args.tokenizer}; {args.workers} workers; {os.cpu_count()} cores", flush=True)
        print("| round | tool | seconds | MB/s | peak RSS MB | load avg |\n|---|---|---|---|---|---|", flush=True)
        for r in range(args.rounds):
            for name, python in sides if r % 2 == 0 else sides[::-1]:
                load = os.getloadavg()[0]
                seconds, rss = timed(python, name, tmp / "corpus", tmp / name, args.tokenizer, args.workers)
                print(f"| {r + 1} | {name} | {seconds:.1f} | {mb / seconds:.2f} | {rss:.0f} | {load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
