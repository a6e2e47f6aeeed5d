"""What quantization costs a trained run in quality: held-out perplexity (`systolic eval lm --data` on the run's
own validation documents), teacher-forced top-1 agreement with the float model (the share of held-out positions
whose argmax is the float model's), and free-running greedy agreement (continuations through the inference
engine: how many are identical to the float model's, and the mean length of the common beginning), also with
an int8 KV cache (which only the engine reads, so it has no perplexity here).

    PYTHONPATH=src python benchmarks/studies/quantization_quality.py runs/lm-small                  # int8, w8a8, fp8
    PYTHONPATH=src python benchmarks/studies/quantization_quality.py runs/lm-small --schemes int8 --prompts 64

The held-out text is the run's validation split (data.path, data.max_bytes, data.val_percent of its config, split
by the same name hash as training), written to a .jsonl that `systolic eval lm --data` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a trained lm run")
    p.add_argument("--schemes", default="int8,w8a8,fp8", help="quantization schemes (default int8,w8a8,fp8)")
    p.add_argument("--prompts", type=int, default=32, help="greedy continuations compared (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens of held-out text per prompt (default 64)")
    p.add_argument("--new", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="held-out text scored (default 2 MB)")
    p.add_argument("--kv-int8-with", default=",int8", help="weights (schemes; empty: float32) whose greedy "
                   "continuations are also compared with an int8 KV cache (default: float32 and int8)")
    return p.parse_args(argv)


def held_out(run_dir: Path, limit: int, out: Path) -> list:
    """The run's validation documents (at most `limit` bytes), also written to `out` as {"text": ...} lines."""
    from systolic.data import corpus
    from systolic.engine import finished
    from systolic.workloads.lm.config import LMConfig

    cfg = finished.read_config(run_dir, LMConfig, "quantization_quality")
    docs = corpus.read_documents(cfg.data.path, max_bytes=cfg.data.max_bytes)
    val, size = [], 0
    for doc in corpus.split_documents(docs, cfg.data.val_percent)[1]:
        if size >= limit:
            break
        val.append(doc)
        size += len(doc.text.encode())
    out.write_text("".join(json.dumps({"text": d.text}) + "\n" for d in val), encoding="utf-8")
    return val


def perplexity(run_dir: Path, data: Path, scheme: str | None) -> float:
    from systolic.workloads.lm.evaluate import evaluate_run

    return json.loads(evaluate_run(run_dir, data=str(data), quantize=scheme).splitlines()[-1])["perplexity"]


def argmax_agreement(float_run, run, ids, seq_len: int) -> float:
    """Share of positions of the held-out token stream `ids` where both models' next-token argmax agree."""
    import jax
    import numpy as np
    from flax import nnx

    rows = min(len(ids) // seq_len, 64)
    tokens = np.asarray(ids[: rows * seq_len], np.int32).reshape(rows, seq_len)

    def top1(loaded):
        fn = jax.jit(lambda p, t: nnx.merge(loaded.graphdef, p)(t).argmax(-1))  # (8, seq_len)
        return np.concatenate([np.asarray(fn(loaded.params, tokens[i:i + 8])) for i in range(0, rows, 8)])

    return float((top1(float_run) == top1(run)).mean())


def continuations(run, prompts: list[list[int]], new: int, kv_cache: str = "auto") -> list[list[int]]:
    """Greedy continuations of every prompt through the inference engine (all in flight together), its KV cache
    stored as `kv_cache` says."""
    from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams

    page = 16
    pages = len(prompts) * -(-(len(prompts[0]) + new) // page) + 1
    engine = InferenceEngine(run.cfg.model, run.params, run.tokenizer, kv_pages=pages, page_size=page,
                             max_seqs=len(prompts), max_tokens_per_step=256, kv_cache=kv_cache)
    out = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=new, temperature=0.0, stop_token_ids=()))
    while engine.has_work():
        for e in engine.step():
            out[int(e.request_id)].append(e.token_id)
    return [out[i] for i in range(len(prompts))]


def agreement(outs: list[list[int]], base: list[list[int]]) -> tuple[int, float]:
    """(how many continuations equal the float model's, the mean length of their common beginning)."""
    import numpy as np

    same = sum(a == b for a, b in zip(outs, base))
    common = float(np.mean([next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                            for a, b in zip(outs, base)]))
    return same, common


def _row(name: str, cells: tuple[str, str, str], agree: tuple[int, float], prompts: int) -> None:
    same, common = agree
    print(f"{name:<18} {cells[0]:>10} {cells[1]:>8} {cells[2]:>11} {same:>4}/{prompts:<5} {common:>7.1f}", flush=True)


def main(argv=None) -> int:
    args = _args(argv)
    import numpy as np

    from systolic.workloads.lm.loaded_run import load_run

    schemes = [s for s in args.schemes.split(",") if s]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "held_out.jsonl"
        docs = held_out(args.run_dir, args.max_bytes, data)
        print(f"{args.run_dir}: {len(docs)} held-out documents, {data.stat().st_size / 1e6:.2f} MB", flush=True)
        base = load_run(args.run_dir, "quantization_quality")
        ids = np.concatenate([base.tokenizer.encode(d.text) for d in docs])
        seq_len = base.cfg.data.seq_len
        starts = np.linspace(0, len(ids) - args.prompt_tokens - 1, args.prompts).astype(int)
        prompts = [ids[s:s + args.prompt_tokens].tolist() for s in starts]
        t = time.perf_counter()
        float_ppl = perplexity(args.run_dir, data, None)
        float_out = continuations(base, prompts, args.new)
        print(f"float32: perplexity {float_ppl:.4f} ({time.perf_counter() - t:.0f} s)", flush=True)
        # Each row printed as soon as it is measured.
        print(f"\n{'weights':<18} {'perplexity':>10} {'delta':>8} {'top-1 agree':>11} {'identical':>10} {'common':>7}")
        print(f"{'float32':<18} {float_ppl:>10.4f} {'':>8} {'':>11} {'':>10} {'':>7}", flush=True)
        for scheme in schemes:
            run = load_run(args.run_dir, "quantization_quality", quantize=scheme)
            ppl = perplexity(args.run_dir, data, scheme)
            cells = (f"{ppl:.4f}", f"{ppl / float_ppl - 1:+.2%}", f"{argmax_agreement(base, run, ids, seq_len):.2%}")
            _row(scheme, cells, agreement(continuations(run, prompts, args.new), float_out), len(prompts))
        # The int8 KV cache: only the engine reads it (eval lm scores without a cache), so greedy agreement alone.
        for scheme in args.kv_int8_with.split(","):
            run = load_run(args.run_dir, "quantization_quality", quantize=scheme or None)
            outs = continuations(run, prompts, args.new, kv_cache="int8")
            _row(f"{scheme or 'float32'} + int8 KV", ("-", "-", "-"), agreement(outs, float_out), len(prompts))
    print(f"(identical: greedy continuations of {args.new} tokens equal to float32's, of {len(prompts)} held-out "
          f"prompts of {args.prompt_tokens} tokens; common: mean tokens before the first difference)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
