"""The lm workload as the CLI sees it: its record, and the commands only lm has (generate, serve, export, tokenizer
train, convert from-hf / to-hf) with their arguments. Light: each command imports its modules when it runs."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from systolic.commandline import Command, Lazy, arg
from systolic.errors import UserError
from systolic.kernels.paged_attention import KV_CACHES
from systolic.workloads import PlanSearch, Workload
from systolic.workloads.lm.config import LMConfig, SampleConfig
from systolic.workloads.lm.model.config import SEARCHED_REMATS
from systolic.workloads.lm.hf import architectures
from systolic.workloads.lm.serve.command import API_KEY_ENV

ENTRY = "systolic.workloads.lm.entry"


def _generate(args: argparse.Namespace) -> int:
    print(WORKLOAD.command("generate")(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                                       args.top_p, args.seed, chat=args.chat, system=args.system,
                                       quantize=args.quantize, kv_cache=args.kv_cache))
    return 0


def _export(args: argparse.Namespace) -> int:
    from systolic.workloads.lm.export import export_run

    platforms = [p.strip() for p in args.platforms.split(",")] if args.platforms else None
    paths = export_run(args.run_dir, args.out, what=args.what, platforms=platforms, force=args.force)
    print("wrote " + ", ".join(f"{p} ({p.stat().st_size / 1e6:.2f} MB)" for p in paths))
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from systolic.workloads.lm.model.quant import param_bytes
    from systolic.workloads.lm.quantize import quantize_run

    run = quantize_run(args.run_dir, args.out, args.scheme)
    print(f"wrote {args.out}: {args.run_dir}'s step {run.step} with {args.scheme} weights ({param_bytes(run.params) / 1e6:.2f} "
          f"MB of parameters); serve it with `systolic serve {args.out}`")
    return 0


def _train_tokenizer(args: argparse.Namespace) -> int:
    from systolic import config as config_lib
    from systolic.data.bpe import train_to_file

    tree = config_lib.apply_overrides({}, args.overrides)
    read = ("data.path=", "data.max_bytes=", "data.val_percent=")  # what a tokenizer is trained from
    others = [item for item in args.overrides if not item.startswith(read)]
    if others:
        raise UserError(f"`systolic tokenizer train` reads only data.* settings (data.path, data.max_bytes, "
                        f"data.val_percent), but got {', '.join(others)}. Fix: drop those overrides, e.g. "
                        "`systolic tokenizer train --vocab-size 8192 data.path=corpus/ --out tok.json`.")
    data = config_lib.from_dict(LMConfig, tree).data
    print(train_to_file(data.path, max_bytes=data.max_bytes, val_percent=data.val_percent, vocab_size=args.vocab_size,
                        out=args.out, force=args.force))
    return 0


def _from_hf(args: argparse.Namespace) -> int:
    from systolic.workloads.lm.hf import convert as hf

    cfg = hf.import_run(args.src, args.run_dir, scan_layers=args.scan_layers)
    print(f"converted {args.src} ({cfg.model.family}, {cfg.model.layers} layers, d_model {cfg.model.d_model}, "
          f"vocabulary {cfg.model.vocab_size}) into {args.run_dir}; fine-tune with `systolic train lm "
          f"init.from={args.run_dir} data.path=...`")
    return 0


def _to_hf(args: argparse.Namespace) -> int:
    from systolic.workloads.lm.hf import convert as hf

    files = hf.export_run(args.run_dir, args.out, max_shard_bytes=hf.parse_size(args.max_shard_size))
    print(f"wrote {args.out}: {', '.join(files)}")
    return 0


# The weights quantized after loading (lm/model/quant.py SCHEMES; a run `systolic quantize` wrote needs none).
QUANTIZE_SCHEMES = ("int8", "w8a8", "fp8")
_SCHEMES_HELP = ("int8: int8 weights (per output channel); w8a8: int8 weights and activations; fp8: float8_e4m3fn "
                 "weights and activations (GPU/TPU)")
_QUANTIZE = arg("--quantize", choices=QUANTIZE_SCHEMES, help=f"quantize the weights after loading ({_SCHEMES_HELP})")
_KV_CACHE = dict(choices=KV_CACHES, default="auto", help="how the KV cache stores keys and values: auto (the "
                 "model's compute dtype, default) or int8 (a float32 scale per token and head: about half of "
                 "bfloat16's memory, so about twice the tokens fit)")

def _run_default(name: str, meaning: str) -> str:
    """The help of a generate option that defaults to the run's `sample` setting: what it means and that default."""
    default = getattr(SampleConfig(), name)
    return f"{meaning} (default: the run's sample.{name}, {default} unless its recipe or overrides set it)"


_GENERATE = Command(
    "generate", help="sample text from a trained lm run directory", run=_generate,
    args=(arg("run_dir", type=Path),
          arg("--prompt", help="the text to continue; with --chat, the user's message (default: the run's "
              "sample.prompt; empty: a fresh document)"),
          arg("--chat", action="store_true", help="render --prompt (and --system) with the run's chat template and "
              "print only the assistant's reply"),
          arg("--system", help="with --chat: the system message before the user's"),
          arg("--max-new-tokens", type=int, help=_run_default("max_new_tokens", "tokens to add at most")),
          arg("--temperature", type=float, help=_run_default("temperature", "0 = greedy")),
          arg("--top-k", type=int, help=_run_default("top_k", "0 = off")),
          arg("--top-p", type=float, help=_run_default("top_p", "1.0 = off")),
          arg("--seed", type=int, help=_run_default("seed", "the sampling seed")),
          _QUANTIZE,
          arg("--kv-cache", **_KV_CACHE)))

_EXPORT = Command(
    "export", help="write a trained lm as serialized StableHLO (jax.export) for deployment", run=_export,
    description="Export the forward pass and/or the KV-cache decode step of a run's latest checkpoint, e.g. "
                "`systolic export runs/lm-tiny --out model.jaxexport`; batch and length are symbolic. Loading needs "
                "only jax: see docs/debugging.md.",
    args=(arg("run_dir", type=Path),
          arg("--out", type=Path, required=True, help="file to write, e.g. model.jaxexport (parameters go beside it "
              "in model.params.npz, a description in model.json)"),
          arg("--what", choices=("forward", "decode", "both"), default="forward",
              help="forward: tokens -> logits (default); decode: tokens + KV cache -> logits + cache; both"),
          arg("--platforms", help="comma-separated, of cpu, cuda, rocm, tpu (default: this machine's)"),
          arg("--force", action="store_true", help="replace existing output files")))

_QUANTIZE_CMD = Command(
    "quantize", help="store an lm run's weights quantized (int8, fp8) as a run directory to serve", run=_quantize,
    description="Quantize a run's latest checkpoint through Qwix and write it as a new run directory that `systolic "
                "serve`, `generate` and `eval lm` load without the float weights, e.g. `systolic quantize runs/lm-small "
                "--scheme int8 --out runs/lm-small-int8`. See docs/quantization.md.",
    args=(arg("run_dir", type=Path, help="an lm run directory (trained, fine-tuned, LoRA or imported)"),
          arg("--scheme", choices=QUANTIZE_SCHEMES, required=True, help=_SCHEMES_HELP),
          arg("--out", type=Path, required=True, help="the run directory to create")))

_TOKENIZER = Command(
    "tokenizer", help="train a BPE tokenizer for the lm workload (then data.tokenizer=FILE)",
    subcommands=(Command(
        "train", help="train a byte-level BPE on a corpus and write its tokenizer.json", run=_train_tokenizer,
        compiles=False,
        description="Train a byte-level BPE on the training split of a corpus (data.* settings as for `systolic "
                    "train lm`; default: the Python standard library), e.g. `systolic tokenizer train --vocab-size "
                    "8192 data.path=corpus/ --out tok.json`, then `systolic train lm data.tokenizer=tok.json`.",
        args=(arg("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. data.path=corpus/ data.max_bytes=5000000"),
              arg("--vocab-size", type=int, required=True, help="ids in the vocabulary, e.g. 8192"),
              arg("--out", type=Path, required=True, help="the tokenizer.json to write"),
              arg("--force", action="store_true", help="replace an existing --out file"))),))

_CONVERT = Command(
    "convert", help=f"convert lm weights from or to Hugging Face ({architectures.help_text()})", metavar="DIRECTION",
    description="Convert between Hugging Face folders (config.json + safetensors) and lm run directories, e.g. "
                "`systolic convert from-hf ./hf-llama runs/llama`, then `systolic train lm init.from=runs/llama "
                "data.path=notes/`.",
    subcommands=(
        Command("from-hf", help="a local Hugging Face folder -> a run directory (step-0 parameters)", run=_from_hf,
                args=(arg("src", type=Path, help="folder with config.json and *.safetensors (and tokenizer.json)"),
                      arg("run_dir", type=Path, help="the run directory to create"),
                      arg("--scan-layers", action="store_true", help="stack the layers (model.scan_layers=true)"))),
        Command("to-hf", help="a run directory's latest checkpoint -> a Hugging Face folder", run=_to_hf,
                args=(arg("run_dir", type=Path),
                      arg("out", type=Path, help="the folder to create (from_pretrained loads it)"),
                      arg("--max-shard-size", default="5GB", help="split safetensors files above this size "
                          "(default 5GB)")))))


_SERVE = Command(
    "serve", help="serve an lm run over HTTP with the OpenAI API (continuous batching, paged KV cache)",
    run=Lazy("systolic.workloads.lm.serve.command:run"), stepping=True,
    description="Serve a run's latest checkpoint with the OpenAI API (/v1/completions, /v1/chat/completions, "
                "/v1/models, /health, /metrics), e.g. `systolic serve runs/lm-tiny --port 8000`, then "
                "`curl localhost:8000/v1/completions -d '{\"model\": \"lm-tiny\", \"prompt\": \"def \"}'`. "
                "See docs/serving.md.",
    args=(arg("run_dir", type=Path, help="an lm run directory (trained, fine-tuned, LoRA or imported)"),
          arg("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; any "
              "other needs --api-key)"),
          arg("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)"),
          arg("--api-key", help=f"clients must send `Authorization: Bearer KEY` (default: ${API_KEY_ENV})"),
          arg("--max-queue", type=int, default=64, help="requests that may wait for a place in the batch; past "
              "that a request gets 429 with Retry-After (default 64)"),
          arg("--grace-s", type=float, default=20.0, help="on SIGTERM or Ctrl-C, seconds to let requests in flight "
              "finish before cancelling them (default 20)"),
          arg("--kv-memory-gib", type=float, help="memory for the KV cache's pages (default: a fraction of the "
              "device's free memory)"),
          arg("--page-size", type=int, default=None,
              help="tokens per KV-cache page (default 16; 128 for --kv-cache int8 on a TPU, as its kernel reads them)"),
          arg("--max-seqs", type=int, default=16, help="requests generating together (default 16)"),
          arg("--max-tokens-per-step", type=int, help="prompt and decode tokens in one step (default: 256, or 4 x "
              "--max-seqs when that is more); longer prompts are prefilled in chunks"),
          arg("--no-prefix-caching", dest="prefix_caching", action="store_false",
              help="do not share the KV pages of prompts' common beginnings between requests"),
          arg("--mesh-tensor", type=int, default=1, help="devices to split the model over (tensor parallelism; "
              "default 1)"),
          _QUANTIZE,
          arg("--kv-cache", **_KV_CACHE)))

_EVAL_OPTIONS = (
    arg("--data", metavar="FILE", help="score this text (a file, a folder of text files, a .jsonl with field 'text' "
        "or a .parquet, as data.path reads them): nats/token, nats/byte, bits/byte, perplexity"),
    arg("--choices", type=Path, metavar="FILE.jsonl", help='score multiple choice: one {"context": str, "choices": '
        '[str, ...], "label": int} a line; accuracy and acc_norm'),
    arg("--batch-size", type=int, metavar="N", help="rows per batch (default: the run's train.batch_size / "
        "train.grad_accum), rounded up to a multiple of the data-parallel devices"),
    _QUANTIZE)

def _configure_search(cfg: LMConfig, remat: str, batch: int) -> LMConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat),
                               train=dataclasses.replace(cfg.train, batch_size=batch))


WORKLOAD = Workload(
    name="lm", config=LMConfig, default_recipe="lm-tiny",
    commands={"train": Lazy(f"{ENTRY}:train"), "generate": Lazy(f"{ENTRY}:generate"),
              "eval": Lazy(f"{ENTRY}:evaluate"), "bench": Lazy(f"{ENTRY}:build_bench_task"),
              "plan": Lazy(f"{ENTRY}:plan"), "plan_serve": Lazy(
                  "systolic.workloads.lm.serve.planned_step:serve_model")},
    options={"eval": _EVAL_OPTIONS},
    # With init.from: the source's model and tokenizer.
    resolve_config=Lazy("systolic.workloads.lm.resolve:resolve_config"),
    own_commands=(_GENERATE, _SERVE, _QUANTIZE_CMD, _EXPORT, _TOKENIZER, _CONVERT),
    plan_search=PlanSearch(SEARCHED_REMATS, _configure_search))
