"""The inference engine alone (no HTTP): output tokens/s, time to first token and time per output token of a
recipe's model with random weights, at several numbers of requests in flight. The serving row of
`benchmarks/harness/gpu.sh`; on CPU it says what the engine gives before the server's own costs
(`benchmarks/peers/serve_vs_peers.py` measures those, against other servers).

    PYTHONPATH=src python benchmarks/studies/serve_engine.py                     # lm-tiny-sized Llama, CPU
    PYTHONPATH=src python benchmarks/studies/serve_engine.py --recipe llama-1b --dtype bfloat16 --levels 1,16,64,128
    PYTHONPATH=src python benchmarks/studies/serve_engine.py --kv-cache int8      # keys and values in int8
    PYTHONPATH=src python benchmarks/studies/serve_engine.py --recipe llama-8b --dtype bfloat16 --quantize int8 \
        --kv-cache int8 --levels 1,64,256 --max-seqs 256 --output 128            # Llama-3-8B on one v5e

`--quantize` serves the weights as `systolic serve --quantize` does (lm/model/quant.py: the projections and an untied
LM head int8 with a scale per output channel, in the compute dtype as serve/weights.py stores it; w8a8 quantizes the
activations too), drawn directly in that form: no float copy of the model is ever made, on the host or the device
(random_params).

Per level N: 2N requests of --prompt random ids and exactly --output new tokens (no end token is sampled: the
sampler's vocabulary limit stops short of it), greedy, N in flight at a time (a finished one is replaced at
once). Every step size is compiled before timing. tokens/s counts output tokens over the level's wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

# A CPU default as small as the CLI's benchmark model (benchmarks/peers/serve_vs_peers.py): 4 x 256, 4 heads, 2 KV
# heads.
CPU_MODEL = ["model.family=llama", "model.layers=4", "model.d_model=256", "model.heads=4", "model.kv_heads=2",
             "model.mlp_dim=704", "model.max_seq_len=1024", "model.vocab_size=4096", "model.vocab_multiple=64"]
WEIGHT_STD = 0.02  # of every random weight (GPT-2's initializer's)
# Of int8 values uniform over [-128, 127] (sqrt((256^2 - 1) / 12)): times a scale of WEIGHT_STD / INT8_STD, a
# quantized weight has the float weights' spread.
INT8_STD = 73.9
CHUNK = 1 << 24  # values drawn at once: a float leaf's float32 draw takes 64 MiB at a time, never the whole leaf


def _args(argv=None) -> argparse.Namespace:
    from systolic.kernels.paged_attention import KV_CACHES  # light: no jax before the CPU tuning
    from systolic.workloads.lm.commands import QUANTIZE_SCHEMES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", help="an lm recipe whose model to serve (default: a 4 x 256 Llama)")
    p.add_argument("--dtype", default="float32", help="model.dtype (default float32)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides on the recipe's "
                   "model, e.g. --set model.layers=18 (a Gemma-2B shape from llama-1b: "
                   "benchmarks/harness/tpu_bench.py)")
    p.add_argument("--kv-cache", default="auto", choices=KV_CACHES, help="as `systolic serve --kv-cache` "
                   "(default auto: the compute dtype)")
    p.add_argument("--quantize", choices=QUANTIZE_SCHEMES, help="the weights as `systolic serve --quantize` serves "
                   "them, drawn quantized (int8: int8 weights; w8a8: int8 weights and activations; fp8)")
    p.add_argument("--levels", default="1,4,16,64", help="requests in flight (default 1,4,16,64)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--max-seqs", type=int, default=64, help="engine batch (default 64)")
    p.add_argument("--kv-memory-gib", type=float, help="the pool's GiB, as `systolic serve --kv-memory-gib` (default: "
                   "80%% of the device's free memory after the weights), cut to 4x what the levels hold and never "
                   "less")
    p.add_argument("--page-size", type=int, default=None, help="default: as systolic serve (16; int8 on a TPU 128)")
    p.add_argument("--max-tokens-per-step", type=int, help="as `systolic serve --max-tokens-per-step` (default: 256, "
                   "or 4 x --max-seqs when that is more)")
    p.add_argument("--json", help="also write one JSON line per level to this file")
    p.add_argument("--profile", metavar="DIR", help="after the levels, trace each of --profile-levels once more "
                   "with jax.profiler into DIR/serve-N.xplane.pb (read it with benchmarks/harness/tpu_profile.py "
                   "--summarize)")
    p.add_argument("--profile-levels", default="1", help="in flight, for --profile (default 1)")
    p.add_argument("--profile-output", type=int, help="output tokens per request of a traced level (default "
                   "--output; fewer keep the trace small)")
    return p.parse_args(argv)


def build_engine(args):
    """An engine over random weights (random_params), with the pool that the levels use."""
    import jax
    import numpy as np

    from systolic import config as config_lib
    from systolic.data.tokenizer import ByteTokenizer
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.model import quant
    from systolic.workloads.lm.serve.engine import InferenceEngine
    from systolic.kernels.paged_attention.pool import default_page_size
    from systolic.workloads.lm.serve.sizing import pool_pages

    overrides = [f"model.dtype={args.dtype}"] + ([] if args.recipe else CPU_MODEL) + args.set
    cfg = config_lib.load(LMConfig, args.recipe, overrides, "lm-tiny", "lm")[0] if args.recipe else \
        config_lib.from_dict(LMConfig, config_lib.apply_overrides({}, overrides))
    model = cfg.model
    if args.quantize:  # the activations as the scheme says (weight-only int8: the compute dtype), as load_run sets
        model = dataclasses.replace(model, quant=quant.SCHEMES[args.quantize][1])
    vocab = model.padded_vocab(model.vocab_size or 32768)  # a 32k tokenizer where the recipe derives it
    params = random_params(model, vocab, args.quantize)
    # The pool: what `systolic serve` would take on this device beside these weights, cut to 4x what max_seqs
    # requests of prompt + output hold (the levels use no more) and never less than that.
    if args.page_size is None:
        args.page_size = default_page_size(args.kv_cache, jax.devices()[0].platform)
    need = args.max_seqs * -(-(args.prompt + args.output) // args.page_size) + 1
    pages, _ = pool_pages(model, args.page_size, kv_memory_gib=args.kv_memory_gib, max_seqs=args.max_seqs,
                          device=jax.devices()[0], split=1, kv_cache=args.kv_cache)
    pages = max(min(pages, 4 * need), need)
    engine = InferenceEngine(model, params, ByteTokenizer(), kv_pages=pages, page_size=args.page_size,
                             max_seqs=args.max_seqs, max_tokens_per_step=args.max_tokens_per_step,
                             kv_cache=args.kv_cache)
    engine.vocab_limit = np.int32(vocab - 1)  # any id but the last: random prompts, no end-of-text stop
    weights = f"{args.quantize} weights" if args.quantize else "weights"
    print(f"model: {model.layers} layers x {model.d_model}, {model.heads} heads ({model.n_kv_heads} KV), "
          f"vocabulary {vocab}, {model.dtype}; {weights} {quant.param_bytes(params) / 2**30:.2f} GiB; KV cache "
          f"{pages - 1:,} pages of {args.page_size} ({args.kv_cache}); {jax.devices()[0]}")
    return engine, vocab


def served_shapes(model, vocab: int, scheme: str | None):
    """The parameters as the engine holds them, abstract (ShapeDtypeStructs): what `systolic serve` serves from a
    float32 checkpoint (serve/weights.py `served_checkpoint`): with `scheme` the projections quantized from float32,
    then every float32 weight a layer casts and the quantized weights' scales stored in the compute dtype."""
    import jax
    from flax import nnx

    from systolic.workloads.lm.model.layers import resolve_dtype
    from systolic.workloads.lm.model.transformer import make_model
    from systolic.workloads.lm.serve.weights import served_checkpoint

    floats = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: make_model(model, vocab, 0)), nnx.Param))
    return jax.eval_shape(lambda p: served_checkpoint(p, scheme, resolve_dtype(model.dtype),
                                                      stacked=model.scan_layers), floats)


def random_params(model, vocab: int, scheme: str | None, *, seed: int = 0):
    """Random parameters on the default device, shaped as served_shapes says: float weights normal with std
    WEIGHT_STD, drawn in float32 CHUNK values at a time and cast; a quantized weight's values uniform over the
    int8 range and its scales WEIGHT_STD / INT8_STD (so it has the float weights' spread). Drawn on the host with
    NumPy (jax.random under jit compiles slowly on CPU, and would differ between platforms), one leaf at a time,
    each on the device before the next is drawn.

    Peak host memory: one leaf (its values, plus a float32 chunk of 64 MiB for a float leaf) besides what the
    device holds. On an accelerator that is all: for llama-8b with int8 weights the largest leaf is a stacked MLP
    projection (32 x 4096 x 14336 int8, 1.75 GiB), and the device holds the 7.97 GiB served model. On CPU the device
    is the host: llama-8b's int8 model drawn with JAX_PLATFORMS=cpu peaked at 8.67 GiB resident (ru_maxrss; 0.18
    before), in 53 s on this project's loaded 2-core host (2026-12-06)."""
    import jax
    import numpy as np

    from systolic.workloads.lm.model import quant

    rng = np.random.default_rng(seed)
    device = jax.devices()[0]

    def put(host: np.ndarray) -> jax.Array:
        leaf = jax.device_put(host, device)
        leaf.block_until_ready()  # the transfer is done before the host copy is dropped and the next leaf drawn
        return leaf

    def normal(n: int) -> np.ndarray:
        return rng.standard_normal(n, np.float32) * np.float32(WEIGHT_STD)

    def uniform_int8(n: int) -> np.ndarray:
        return rng.bit_generator.random_raw(-(-n // 8)).view(np.int8)[:n]  # 8 random bytes a draw: the fastest

    def draw(leaf):
        if not quant.is_quantized(leaf):
            return put(_filled(leaf.shape, leaf.dtype, normal))
        scale = np.full(leaf.scale.shape, WEIGHT_STD / INT8_STD, leaf.scale.dtype)
        return dataclasses.replace(leaf, qvalue=put(_filled(leaf.qvalue.shape, leaf.qvalue.dtype, uniform_int8)),
                                   scale=put(scale))

    return jax.tree.map(draw, served_shapes(model, vocab, scheme), is_leaf=quant.is_quantized)


def _filled(shape: tuple[int, ...], dtype, draw):
    """An array of `shape` and `dtype` filled CHUNK values at a time from draw(n) (n values, cast on assignment)."""
    import numpy as np

    out = np.empty(shape, dtype)
    flat = out.reshape(-1)  # a view: filling it fills `out`
    for start in range(0, flat.size, CHUNK):
        flat[start:start + CHUNK] = draw(min(CHUNK, flat.size - start))
    return out


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

    start, waited = time.perf_counter(), engine.waited_s
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
            # the host's own time a step: the wall time less its waits for the device's results
            "host_ms": (wall - (engine.waited_s - waited)) / steps * 1e3,
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
    from systolic.errors import UserError

    try:
        engine, vocab = build_engine(args)
        t = time.perf_counter()
        engine.warmup()
    except UserError as e:  # a pool or a step that does not fit: the engine's paragraph, not a traceback
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print(f"warm-up (every step size compiled): {time.perf_counter() - t:.1f} s")
    rows = []
    print(f"{'in flight':>9} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'step':>7} {'host':>7}  (ms)")
    for n in (int(x) for x in args.levels.split(",")):
        row = run_level(engine, vocab, n, args)
        rows.append(row)
        print(f"{n:>9} {row['tok_s']:>9.0f} {row['ttft_p50_ms']:>9.1f} {row['ttft_p99_ms']:>9.1f} "
              f"{row['tpot_p50_ms']:>9.1f} {row['tpot_p99_ms']:>9.1f} {row['step_ms']:>7.2f} {row['host_ms']:>7.2f}",
              flush=True)
    for n in (int(x) for x in args.profile_levels.split(",") if args.profile):
        trace(engine, vocab, n, args)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"recipe": args.recipe or "cpu-4x256", "dtype": args.dtype,
                                    "quantize": args.quantize, "kv_cache": args.kv_cache,
                                    "max_tokens_per_step": engine.max_tokens_per_step, **row}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
