"""The `systolic serve RUN_DIR` command's options, and the call from parsed options to `server.serve`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

API_KEY_ENV = "SYSTOLIC_API_KEY"  # the key without putting it on the command line, where `ps` shows it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="an lm run directory (trained, fine-tuned, LoRA or imported)")
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; any "
                     "other needs --api-key)")
    net.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)")
    net.add_argument("--api-key", help=f"clients must send `Authorization: Bearer KEY` (default: ${API_KEY_ENV})")
    net.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a place in the batch; "
                     "past that a request gets 429 with Retry-After (default 64)")
    net.add_argument("--grace-s", type=float, default=20.0, help="on SIGTERM or Ctrl-C, seconds to let requests in "
                     "flight finish before cancelling them (default 20)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--kv-memory-gib", type=float, help="memory for the KV cache's pages (default: a fraction of "
                        "the device's free memory)")
    engine.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page (default 16)")
    engine.add_argument("--max-seqs", type=int, default=16, help="requests generating together (default 16)")
    engine.add_argument("--max-tokens-per-step", type=int, default=256, help="prompt and decode tokens in one step "
                        "(default 256); longer prompts are prefilled in chunks")
    engine.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="do not share the KV pages of prompts' common beginnings between requests")
    engine.add_argument("--mesh-tensor", type=int, default=1, help="devices to split the model over (tensor "
                        "parallelism; default 1)")


def run(args: argparse.Namespace) -> int:
    from systolic.workloads.lm.serve.server import serve

    api_key = os.environ.get(API_KEY_ENV) if args.api_key is None else args.api_key
    serve(args.run_dir, host=args.host, port=args.port, api_key=api_key,
          kv_memory_gib=args.kv_memory_gib, page_size=args.page_size, max_seqs=args.max_seqs,
          max_tokens_per_step=args.max_tokens_per_step, max_queue=args.max_queue, prefix_caching=args.prefix_caching,
          mesh_tensor=args.mesh_tensor, grace_s=args.grace_s)
    return 0
