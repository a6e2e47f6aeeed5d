"""`systolic data prepare` against Hugging Face `datasets` on the same corpus and tokenizer: MB of text per second.

    PYTHONPATH=src python benchmarks/data_prepare.py --copies 8 --workers 2          # 252 MB of .py, byte-level
    PYTHONPATH=src python benchmarks/data_prepare.py --copies 1 --tokenizer tok.json # a BPE
    PYTHONPATH=src /tmp/dsvenv/bin/python benchmarks/data_prepare.py --copies 1 --tokenizer tok.json --hf

The corpus is the standard library's `.py` files hard-linked `--copies` times under different folder names (the
names differ, so the train/validation split differs per copy; the text repeats, which neither tool exploits).
systolic: stream, tokenize in `--workers` processes, write uint16 shards and the index. `datasets` (only with
--hf, in an environment that has it; it is not a systolic dependency): `load_dataset("text", sample_by=
"document")`, `map(batched=True, num_proc=workers)` with the same tokenizer.json, `save_to_disk` (Arrow). Both
times include reading and writing; both start with a cold output folder and a warm page cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path


def make_corpus(root: Path, copies: int) -> int:
    """Hard links of the standard library's UTF-8 .py files, `copies` times; returns the total bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for i in range(copies):
        for file in sorted(stdlib.rglob("*.py")):
            rel = file.relative_to(stdlib)
            if rel.parts[0] in ("site-packages", "dist-packages") or not _is_utf8(file):
                continue  # a few test modules are Latin-1: `datasets` cannot read them, so neither tool gets them
            dst = root / f"copy{i}" / rel
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


def run_systolic(corpus: Path, out: Path, tokenizer: str, workers: int) -> float:
    from systolic.data.prepare import prepare

    start = time.perf_counter()
    print(prepare(str(corpus), out, tokenizer=tokenizer, workers=workers))
    return time.perf_counter() - start


def run_datasets(corpus: Path, out: Path, tokenizer: str, workers: int) -> float:
    import datasets
    from tokenizers import Tokenizer

    files = sorted(str(p) for p in corpus.rglob("*.py"))
    tok = Tokenizer.from_file(tokenizer)

    def encode(batch):
        return {"ids": [e.ids for e in tok.encode_batch(batch["text"])]}

    start = time.perf_counter()
    ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                               cache_dir=str(out.parent / "hf-cache"))
    ds.map(encode, batched=True, num_proc=workers, remove_columns=["text"]).save_to_disk(str(out))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json (needed for --hf)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hf", action="store_true", help="also time Hugging Face datasets")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        total = make_corpus(tmp / "corpus", args.copies)
        mb = total / 1e6
        print(f"corpus: {mb:.1f} MB in {sum(1 for _ in (tmp / 'corpus').rglob('*.py')):,} files; "
              f"tokenizer {args.tokenizer}; {args.workers} workers; {os.cpu_count()} cores; "
              f"load average {os.getloadavg()[0]:.1f}")
        seconds = run_systolic(tmp / "corpus", tmp / "systolic", args.tokenizer, args.workers)
        print(f"systolic data prepare: {seconds:.1f} s, {mb / seconds:.2f} MB/s")
        if args.hf:
            seconds = run_datasets(tmp / "corpus", tmp / "hf", args.tokenizer, args.workers)
            print(f"datasets map(num_proc={args.workers}) + save_to_disk: {seconds:.1f} s, {mb / seconds:.2f} MB/s")


if __name__ == "__main__":
    main()
