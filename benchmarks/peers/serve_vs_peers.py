"""`systolic serve` against the servers a CPU user would pick, on one model: `transformers serve` (Hugging Face's
OpenAI-compatible server, with continuous batching) and llama.cpp's server (`llama-cpp-python`), all over loopback,
all driven by the `openai` client.

The model is tiny but real: a 4-layer, 256-wide Llama (4 heads, 2 key/value heads) with a byte-level BPE of 4,096
ids trained here on the Python standard library, made by `transformers` from a config with random weights (std
0.2, so greedy choices have no near-ties) and saved in float32; systolic imports it with `systolic convert
from-hf`, llama.cpp reads it converted to GGUF at f32 by this script (the `gguf` package's writer). The end-of-text
row of the output layer is zero, so no reply ends early: every request generates exactly --output tokens.

Each side runs in its own server process. Requests use greedy decoding and streaming; per concurrency level
(1, 4, 16, 64 requests in flight; 2 x concurrency requests, at least 4) the script measures output tokens/s over
the level's wall time, time to first token (TTFT) and time per output token after the first (TPOT), p50/p99. The
shared-prefix case sends prompts that share their first 3/4 (a system prompt) at concurrency 16. Sides alternate
within every level and every round, and while one side is measured the others are paused (SIGSTOP). Before
timing, greedy replies are compared between the sides; after the servers stop, `systolic generate`'s engine is
timed against transformers' `generate` on one prompt (both loaded and compiled).

    PYTHONPATH=src python benchmarks/peers/serve_vs_peers.py                  # about 10-20 minutes on 2 cores
    PYTHONPATH=src python benchmarks/peers/serve_vs_peers.py --levels 1,4 --rounds 1 --sides systolic,transformers
    PYTHONPATH=src python benchmarks/peers/serve_vs_peers.py --levels 16 --rounds 3 \
        --sides systolic,systolic-int8,systolic-w8a8

Needs the `bench` extra: pip install -e '.[bench]' (transformers[serving], llama-cpp-python[server], gguf, openai).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

VOCAB = 4096
LAYERS, WIDTH, HEADS, KV_HEADS, MLP = 4, 256, 4, 2, 704
CONTEXT = 1024
ROPE_THETA = 10000.0
EOT = "<|endoftext|>"
START_TIMEOUT_S = 900
SIDES = ("systolic", "transformers", "llama.cpp")
# systolic serving the same run with its weights quantized after loading (`systolic serve RUN --quantize SCHEME`):
# not run by default; name them in --sides to compare against float32 systolic.
QUANTIZED_SIDES = {"systolic-int8": "int8", "systolic-w8a8": "w8a8"}
# llama-cpp-python's server applies a repetition penalty of 1.1 unless told otherwise: off, so greedy is greedy.
EXTRA_BODY = {"llama.cpp": {"repeat_penalty": 1.0}}


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="1,4,16,64", help="concurrency levels (default 1,4,16,64)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"which servers (default {','.join(SIDES)}; also "
                   f"{', '.join(QUANTIZED_SIDES)}: systolic with its weights quantized)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads for llama.cpp (default: all)")
    p.add_argument("--keep", type=Path, help="write the model files here and keep them (default: a temp dir)")
    return p.parse_args(argv)


# THE MODEL ----------------------------------------------------------------------------------------------------


def make_model(root: Path, gguf: bool = True) -> tuple[Path, Path, Path]:
    """(the Hugging Face folder, the systolic run, the GGUF file)."""
    import torch
    import transformers

    hf, run = root / "hf", root / "run"
    for folder in (hf, run):  # an earlier --keep run's
        shutil.rmtree(folder, ignore_errors=True)
    tokenizer = _train_tokenizer()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOT, bos_token=EOT)
    fast.save_pretrained(hf)
    eot = tokenizer.token_to_id(EOT)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=WIDTH, intermediate_size=MLP, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=CONTEXT,
        rope_theta=ROPE_THETA, rms_norm_eps=1e-6, bos_token_id=eot, eos_token_id=eot, tie_word_embeddings=False,
        dtype="float32")
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.normal_(1.0, 0.1)
        model.lm_head.weight[eot] = 0.0  # logit 0, never the argmax: replies run to max_tokens
    model.save_pretrained(hf)
    _check([sys.executable, "-m", "systolic", "convert", "from-hf", str(hf), str(run)], "systolic convert from-hf")
    gguf_path = root / "model-f32.gguf"
    if gguf:  # only llama.cpp's side reads it (and only it needs the `gguf` package)
        write_gguf(model, tokenizer, gguf_path)
    return hf, run, gguf_path


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))[:120]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return bpe


def write_gguf(model, tokenizer, path: Path) -> None:
    """The model as llama.cpp's convert_hf_to_gguf.py writes a Llama at f32: its tensor names, q and k rows
    permuted from Hugging Face's rotate-half RoPE layout to GGML's interleaved pairs, a "gpt2" BPE vocabulary."""
    import gguf
    import numpy as np

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(MLP)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_rope_dimension_count(WIDTH // HEADS)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(cfg.vocab_size)
    vocab = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(cfg.vocab_size)), "ids without holes"
    eot = tokenizer.token_to_id(EOT)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if i == eot else gguf.TokenType.NORMAL for _, i in vocab])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_add_bos_token(False)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    for name, array in _gguf_tensors(state).items():
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_tensors(state: dict) -> dict:
    def permute(w, heads):  # (heads * d_head, d) rotate-half -> interleaved, as convert_hf_to_gguf's LlamaModel.permute
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"],
           "output.weight": state["lm_head.weight"]}
    for i in range(LAYERS):
        hf = f"model.layers.{i}."
        out |= {f"blk.{i}.attn_norm.weight": state[hf + "input_layernorm.weight"],
                f"blk.{i}.attn_q.weight": permute(state[hf + "self_attn.q_proj.weight"], HEADS),
                f"blk.{i}.attn_k.weight": permute(state[hf + "self_attn.k_proj.weight"], KV_HEADS),
                f"blk.{i}.attn_v.weight": state[hf + "self_attn.v_proj.weight"],
                f"blk.{i}.attn_output.weight": state[hf + "self_attn.o_proj.weight"],
                f"blk.{i}.ffn_norm.weight": state[hf + "post_attention_layernorm.weight"],
                f"blk.{i}.ffn_gate.weight": state[hf + "mlp.gate_proj.weight"],
                f"blk.{i}.ffn_up.weight": state[hf + "mlp.up_proj.weight"],
                f"blk.{i}.ffn_down.weight": state[hf + "mlp.down_proj.weight"]}
    return out


# PROMPTS ------------------------------------------------------------------------------------------------------


def make_prompts(tokenizer, n: int, length: int, *, shared: int = 0) -> list[str]:
    """`n` texts of `length` tokens from the standard library's source, different from each other; with `shared`,
    all begin with the same text of about `shared` tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids = [i for p in sorted(stdlib.glob("*.py"))[120:200]
           for i in tokenizer.encode(p.read_text(encoding="utf-8", errors="replace")).ids]
    head = tokenizer.decode(ids[:shared]) if shared else ""
    prompts, at = [], shared
    while len(prompts) < n:
        text = head + tokenizer.decode(ids[at:at + length - shared])
        at += length
        if len(tokenizer.encode(text).ids) == length:  # a text whose tokens re-join at the seam is skipped
            prompts.append(text)
    return prompts


# THE SERVERS --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(side: str, hf: Path, run: Path, gguf_path: Path, args, log_dir: Path) -> tuple[subprocess.Popen, str]:
    """A server process and its base URL, once it answers GET /v1/models."""
    port = free_port()
    env = dict(os.environ)
    if side == "systolic" or side in QUANTIZED_SIDES:
        # What `systolic serve` sets up before serve(): the XLA:CPU flags and allocator of a stepping lm process,
        # the compile cache, no TPU probe.
        code = ("import sys; from systolic.runtime import cpu_tuning, compile_cache; "
                "cpu_tuning.apply_at_start(workload='lm', stepping=True); compile_cache.enable(); "
                "from systolic.workloads.lm.serve.server import serve; "
                f"serve(sys.argv[1], port={port}, max_seqs=64, max_queue=256, quantize={QUANTIZED_SIDES.get(side)!r})")
        argv = [sys.executable, "-c", code, str(run)]
        env.setdefault("JAX_PLATFORMS", "cpu")
    elif side == "transformers":
        argv = ["transformers", "serve", str(hf), "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
        argv[0] = str(Path(sys.executable).with_name("transformers"))
    else:
        # interrupt_requests off: by default a new request cuts off the one being generated (one at a time here).
        # The KV cache in float32 (type 0), as the other sides keep it: llama.cpp's default float16 cache moves the
        # logits by ~1e-2, which flips a greedy choice within 64 tokens.
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path), "--host", "127.0.0.1", "--port",
                str(port), "--n_ctx", str(CONTEXT), "--n_threads", str(args.threads), "--n_batch", "512",
                "--interrupt_requests", "False", "--type_k", "0", "--type_v", "0"]
    log = (log_dir / f"{side}.log").open("w")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log_text = (log_dir / f"{side}.log").read_text()
            raise RuntimeError(f"{side} exited with {process.returncode}: {log_text[-3000:]}")
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=5).read()
            return process, url
        except OSError:
            time.sleep(1)
    stop(process)
    raise RuntimeError(f"{side} did not answer within {START_TIMEOUT_S} s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def model_id(url: str) -> str:
    return json.loads(urllib.request.urlopen(f"{url}/v1/models").read())["data"][0]["id"]


# REQUESTS -----------------------------------------------------------------------------------------------------


async def one_request(client, side: str, model: str, prompt: str, output: int) -> tuple[float, float, float]:
    """(TTFT, TPOT, end) of one streamed greedy completion, in seconds from its start (end: perf_counter time)."""
    t0 = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output, temperature=0,
                                             stream=True, extra_body=EXTRA_BODY.get(side))
    first = last = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
    if first is None:
        raise RuntimeError("a stream ended without any text")
    return first - t0, (last - first) / (output - 1), last


async def run_level(side: str, url: str, model: str, prompts: list[str], concurrency: int, output: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt):
        async with gate:
            return await one_request(client, side, model, prompt, output)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    wall = max(end for _, _, end in results) - start
    await client.close()
    return {"tokens_per_s": len(prompts) * output / wall, "ttft": [r[0] for r in results],
            "tpot": [r[1] for r in results]}


def greedy_texts(side: str, url: str, model: str, prompts: list[str], output: int) -> list[tuple[str, int, int]]:
    """(text, prompt tokens, completion tokens) of each prompt's greedy completion, one request at a time."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    out = []
    for prompt in prompts:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=output, temperature=0,
                                      extra_body=EXTRA_BODY.get(side))
        out.append((r.choices[0].text, r.usage.prompt_tokens if r.usage else -1,
                    r.usage.completion_tokens if r.usage else -1))
    return out


# GENERATE -----------------------------------------------------------------------------------------------------


def generate_vs_transformers(hf: Path, run: Path, prompt: str, output: int) -> dict:
    """Seconds for one greedy reply of `output` tokens after `prompt` with the model loaded and compiled: the
    inference engine that `systolic generate` runs (one request, max_seqs=1) against transformers' `generate`; each
    side's second call. And whether the two replies are the same tokens."""
    from systolic.runtime import cpu_tuning

    cpu_tuning.apply_at_start(workload="lm", stepping=True)  # as the CLI does, before jax starts
    import torch
    import transformers

    from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    ids = tokenizer(prompt, return_tensors="pt").input_ids  # (1, P)
    engine = InferenceEngine.from_run(run, max_seqs=1, say=lambda _: None)
    engine.warmup()
    seconds, ours = {}, []
    for i in range(2):
        t = time.perf_counter()
        engine.add_request(f"r{i}", ids[0].tolist(), SamplingParams(max_tokens=output, temperature=0.0))
        ours = []
        while engine.has_work():
            ours += [e.token_id for e in engine.step() if e.token_id is not None]
        seconds["systolic (generate's engine)"] = time.perf_counter() - t
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        for _ in range(2):
            t = time.perf_counter()
            theirs = model.generate(ids, max_new_tokens=output, min_new_tokens=output, do_sample=False)
            seconds["transformers generate"] = time.perf_counter() - t
    return {"seconds": seconds, "same_tokens": ours == theirs[0, ids.shape[1]:].tolist()}


# THE RUN ------------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def main(argv=None) -> int:
    args = _args(argv)
    sides = [s for s in args.sides.split(",") if s]
    levels = [int(c) for c in args.levels.split(",")]
    root = args.keep or Path(tempfile.mkdtemp(prefix="serve-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"model files in {root}", flush=True)
    hf, run, gguf_path = make_model(root, gguf="llama.cpp" in sides)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(hf / "tokenizer.json"))
    servers, failed = {}, {}
    try:
        for side in sides:
            try:
                process, url = start(side, hf, run, gguf_path, args, root)
                servers[side] = (process, url, model_id(url))
                print(f"{side}: up at {url} (model {servers[side][2]!r})", flush=True)
            except Exception as e:  # a peer that does not install or run here is reported, not fatal
                failed[side] = f"{type(e).__name__}: {str(e)[-600:]}"
                print(f"{side}: did not start: {failed[side]}", flush=True)
        check = check_greedy(servers, make_prompts(tokenizer, 4, args.prompt), args.output)
        rows = measure(servers, tokenizer, levels, args)
    finally:
        for process, _, _ in servers.values():
            stop(process)
    gen = generate_vs_transformers(hf, run, make_prompts(tokenizer, 1, args.prompt)[0], args.output)
    report(rows, check, gen, failed, args)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def check_greedy(servers: dict, prompts: list[str], output: int) -> dict:
    """Each side's greedy replies, and whether they equal systolic's."""
    replies = {side: greedy_texts(side, url, model, prompts, output) for side, (_, url, model) in servers.items()}
    for side, answers in replies.items():
        counts = sorted({(p, c) for _, p, c in answers})
        print(f"{side}: (prompt, completion) tokens {counts}", flush=True)
    # Without U+FFFD: a random model writes byte tokens that are broken UTF-8, which Hugging Face's decoders (ours and
    # transformers') show as U+FFFD and llama-cpp-python drops; the tokens are the same.
    base = [t.replace("\ufffd", "") for t, _, _ in replies.get("systolic", [])]
    return {side: sum(a == b.replace("\ufffd", "") for a, (b, _, _) in zip(base, answers))
            for side, answers in replies.items()}


@contextlib.contextmanager
def alone(servers: dict, side: str):
    """The other servers paused (SIGSTOP to their process groups) while `side` is measured: an idle server's
    threads (polling loops, thread pools) would otherwise take CPU from the one under load."""
    others = [process for name, (process, _, _) in servers.items() if name != side and process.poll() is None]
    for process in others:
        os.killpg(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for process in others:
            os.killpg(process.pid, signal.SIGCONT)


def measure(servers: dict, tokenizer, levels: list[int], args) -> list[dict]:
    cases = [(f"{args.prompt} in / {args.output} out", c, 0) for c in levels]
    if 16 in levels:
        cases.append((f"shared prefix {3 * args.prompt // 4} of {args.prompt}", 16, 3 * args.prompt // 4))
    order = list(servers)
    for side, (_, url, model) in servers.items():  # warm-up: first requests, first allocations
        asyncio.run(run_level(side, url, model, make_prompts(tokenizer, 4, args.prompt), 4, args.output))
    raw: dict[tuple, list[dict]] = {}
    for round_ in range(args.rounds):
        for i, (case, concurrency, shared) in enumerate(cases):
            prompts = make_prompts(tokenizer, max(4, 2 * concurrency), args.prompt, shared=shared)
            turn = (round_ + i) % len(order)
            for side in order[turn:] + order[:turn]:  # who goes first alternates
                _, url, model = servers[side]
                try:
                    with alone(servers, side):
                        result = asyncio.run(run_level(side, url, model, prompts, concurrency, args.output))
                except Exception as e:  # a side that fails one level is reported, and measured at the others
                    print(f"round {round_ + 1} {case} c={concurrency} {side}: failed: {e!r}", flush=True)
                    continue
                raw.setdefault((case, concurrency, side), []).append(result)
                print(f"round {round_ + 1} {case} c={concurrency} {side}: {result['tokens_per_s']:.0f} tok/s",
                      flush=True)
    rows = []
    for (case, concurrency, side), results in raw.items():
        ttft = [x for r in results for x in r["ttft"]]
        tpot = [x for r in results for x in r["tpot"]]
        rows.append({"case": case, "concurrency": concurrency, "side": side,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
                     "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
                     "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99)})
    return rows


def report(rows: list[dict], check: dict, gen: dict, failed: dict, args) -> None:
    print(f"\n{LAYERS}-layer {WIDTH}-wide Llama, float32, greedy, {os.cpu_count()} CPU threads; output tokens/s is the "
          f"median of {args.rounds} rounds, TTFT/TPOT percentiles over all of their requests\n")
    print("| case | concurrency | server | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['concurrency']} | {r['side']} | {r['tokens_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | "
              f"{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} |")
    for side, same in check.items():
        print(f"greedy replies equal to systolic's: {side} {same}/4")
    for side, why in failed.items():
        print(f"{side}: not measured ({why})")
    seconds = gen["seconds"]
    print(f"one prompt, {args.output} tokens: " + ", ".join(f"{k} {v:.3f} s ({args.output / v:.0f} tok/s)"
                                                           for k, v in seconds.items())
          + f"; same tokens: {gen['same_tokens']}")
    print(json.dumps({"rows": rows, "greedy_equal": check, "generate": gen, "failed": failed}))


def _check(argv: list[str], what: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed ({result.returncode}): {result.stderr[-3000:]}")


if __name__ == "__main__":
    sys.exit(main())
