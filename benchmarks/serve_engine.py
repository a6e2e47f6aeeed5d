"""The inference engine alone (no HTTP): output tokens/s, time to first token and time per output token of a
recipe's model with random weights, at several numbers of requests in flight. The serving row of
`benchmarks/gpu.sh`; on CPU it says what the engine gives before the server's own costs
(`benchmarks/serve_vs_peers.py` measures those, against other servers).

    PYTHONPATH=src python benchmarks/serve_engine.py                                # lm-tiny-sized Llama, CPU
    PYTHONPATH=src python benchmarks/serve_engine.py --recipe llama-1b --dtype bfloat16 --levels 1,16,64,128
    PYTHONPATH=src python benchmarks/serve_engine.py --kv-cache int8                 # keys and values in int8

Per level N: 2N requests of --prompt random ids and exactly --output new tokens (no end token is sampled: the
sampler's vocabulary limit stops short of it), greedy, N in flight at a time (a finished one is replaced at
once). Every step size is compiled before timing. tokens/s counts output tokens over the level's wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# A CPU default as small as the CLI's benchmark model (benchmarks/serve_vs_peers.py): 4 x 256, 4 heads, 2 KV heads.
CPU_MODEL = ["model.family=llama", "model.layers=4", "model.d_model=256", "model.heads=4", "model.kv_heads=2",
             "model.mlp_dim=704", "model.max_seq_len=1024", "model.vocab_size=4096", "model.vocab_multiple=64"]


def _args(argv=None) -> argparse.Namespace:
    from systolic.workloads.lm.commands import KV_CACHES  # light: no jax before the CPU tuning

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", help="an lm recipe whose model to serve (default: a 4 x 256 Llama)")
    p.add_argument("--dtype", default="float32", help="model.dtype (default float32)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides on the recipe's "
                   "model, e.g. --set model.layers=18 (a Gemma-2B shape from llama-1b: benchmarks/tpu_bench.py)")
    p.add_argument("--kv-cache", default="auto", choices=KV_CACHES, help="as `systolic serve --kv-cache` "
                   "(default auto: the compute dtype)")
    p.add_argument("--levels", default="1,4,16,64", help="requests in flight (default 1,4,16,64)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--max-seqs", type=int, default=64, help="engine batch (default 64)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-tokens-per-step", type=int, default=256)
    p.add_argument("--json", help="also write one JSON line per level to this file")
    p.add_argument("--profile", metavar="DIR", help="after the levels, trace each of --profile-levels once more "
                   "with jax.profiler into DIR/serve-N.xplane.pb (read it with benchmarks/tpu_profile.py --summarize)")
    p.add_argument("--profile-levels", default="1", help="in flight, for --profile (default 1)")
    p.add_argument("--profile-output", type=int, help="output tokens per request of a traced level (default "
                   "--output; fewer keep the trace small)")
    return p.parse_args(argv)


def build_engine(args):
    """An engine over random weights (std 0.02, drawn on the host: jax.random under jit compiles slowly on CPU)."""
    import jax
    import numpy as np
    from flax import nnx

    from systolic import config as config_lib
    from systolic.data.tokenizer import ByteTokenizer
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.model.transformer import make_model
    from systolic.workloads.lm.model.layers import resolve_dtype
    from systolic.workloads.lm.serve.engine import InferenceEngine, pool_pages
    from systolic.workloads.lm.serve.weights import serving_params

    overrides = [f"model.dtype={args.dtype}"] + ([] if args.recipe else CPU_MODEL) + args.set
    cfg = config_lib.load(LMConfig, args.recipe, overrides, "lm-tiny", "lm")[0] if args.recipe else \
        config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))
    model = cfg.model
    vocab = model.padded_vocab(model.vocab_size or 32768)  # a 32k tokenizer where the recipe derives it
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: make_model(model, vocab, 0)), nnx.Param))
    rng = np.random.default_rng(0)
    # Cast on the host as the engine stores them (serve/weights.py), so the float32 copy never takes device memory.
    host = serving_params(jax.tree.map(lambda x: rng.normal(0, 0.02, x.shape).astype(x.dtype), abstract),
                          resolve_dtype(model.dtype))
    params = jax.device_put(host)
    del host
    # The pool: what `systolic serve` would take on this device, cut to 4x what max_seqs requests of prompt + output
    # hold (the levels use no more) and never less than that.
    need = args.max_seqs * -(-(args.prompt + args.output) // args.page_size) + 1
    pages, _ = pool_pages(model, args.page_size, kv_memory_gib=None, max_seqs=args.max_seqs,
                          device=jax.devices()[0], split=1, kv_cache=args.kv_cache)
    pages = max(min(pages, 4 * need), need)
    engine = InferenceEngine(model, params, ByteTokenizer(), kv_pages=pages, page_size=args.page_size,
                             max_seqs=args.max_seqs, max_tokens_per_step=args.max_tokens_per_step,
                             kv_cache=args.kv_cache)
    engine.vocab_limit = np.int32(vocab - 1)  # any id but the last: random prompts, no end-of-text stop
    print(f"model: {model.layers} layers x {model.d_model}, {model.heads} heads ({model.n_kv_heads} KV), "
          f"vocabulary {vocab}, {model.dtype}; KV cache {pages - 1:,} pages of {args.page_size} ({args.kv_cache}); "
          f"{jax.devices()[0]}")
    return engine, vocab


def run_level(engine, vocab: int, n: int, args) -> dict:
    import numpy as np

    from systolic.workloads.lm.serve.engine import SamplingParams

    rng = np.random.default_rng(n)
    total, submitted, arrival, first, last, done = 2 * n, 0, {}, {}, {}, 0
    tokens = 0
    params = SamplingParams(max_tokens=args.output, temperature=0.0, stop_token_ids=())

    def submit():
        nonlocal submitted
        rid = f"r{n}-{submitted}"
        engine.add_request(rid, rng.integers(0, vocab - 1, args.prompt).tolist(), params)
        arrival[rid] = time.perf_counter()
        submitted += 1

    start = time.perf_counter()
    for _ in range(min(n, total)):
        submit()
    steps = 0
    while done < total:
        events = engine.step()
        steps += 1
        now = time.perf_counter()
        for e in events:
            if e.token_id is not None:
                tokens += 1
                first.setdefault(e.request_id, now)
                last[e.request_id] = now
            if e.finish_reason is not None:
                done += 1
                if submitted < total:
                    submit()
    wall = time.perf_counter() - start
    ttft = [first[r] - arrival[r] for r in first]
    tpot = [(last[r] - first[r]) / (args.output - 1) for r in first if args.output > 1]
    q = lambda xs, p: float(np.percentile(xs, p)) * 1e3  # noqa: E731
    return {"in_flight": n, "requests": total, "output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "steps": steps, "step_ms": wall / steps * 1e3,
            "ttft_p50_ms": q(ttft, 50), "ttft_p99_ms": q(ttft, 99), "tpot_p50_ms": q(tpot, 50),
            "tpot_p99_ms": q(tpot, 99), "mean_tpot_ms": statistics.fmean(tpot) * 1e3}


def trace(engine, vocab: int, n: int, args) -> None:
    """The level of `n` in flight once more, traced: its engine steps and wall time beside the device's."""
    import glob
    import shutil
    import tempfile
    from pathlib import Path

    import jax

    folder = tempfile.mkdtemp(prefix="serve-profile-")
    traced = argparse.Namespace(**{**vars(args), "output": args.profile_output or args.output})
    with jax.profiler.trace(folder):
        row = run_level(engine, vocab, n, traced)
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    for path in glob.glob(f"{folder}/**/*.xplane.pb", recursive=True):
        shutil.copy(path, out / f"serve-{n}.xplane.pb")
    print(f"traced {n} in flight: {row['steps']} engine steps in {row['wall_s']:.2f} s ({row['step_ms']:.2f} ms a "
          f"step, TPOT p50 {row['tpot_p50_ms']:.2f} ms) into {out / f'serve-{n}.xplane.pb'}")


def main(argv=None) -> int:
    args = _args(argv)
    from systolic.runtime import compile_cache, cpu_tuning

    cpu_tuning.apply_at_start(workload="lm", stepping=True)  # as `systolic serve` does, before jax starts
    compile_cache.enable()
    engine, vocab = build_engine(args)
    t = time.perf_counter()
    engine.warmup()
    print(f"warm-up (every step size compiled): {time.perf_counter() - t:.1f} s")
    rows = []
    print(f"{'in flight':>9} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'step':>7}  (ms)")
    for n in (int(x) for x in args.levels.split(",")):
        row = run_level(engine, vocab, n, args)
        rows.append(row)
        print(f"{n:>9} {row['tok_s']:>9.0f} {row['ttft_p50_ms']:>9.1f} {row['ttft_p99_ms']:>9.1f} "
              f"{row['tpot_p50_ms']:>9.1f} {row['tpot_p99_ms']:>9.1f} {row['step_ms']:>7.2f}", flush=True)
    for n in (int(x) for x in args.profile_levels.split(",") if args.profile):
        trace(engine, vocab, n, args)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"recipe": args.recipe or "cpu-4x256", "dtype": args.dtype,
                                    "kv_cache": args.kv_cache, **row}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
