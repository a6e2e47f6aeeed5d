"""`systolic serve RUN_DIR`: from the parsed options (declared in workloads/lm/commands.py) to `server.serve`."""

from __future__ import annotations

import argparse
import os

API_KEY_ENV = "SYSTOLIC_API_KEY"  # the key without putting it on the command line, where `ps` shows it


def run(args: argparse.Namespace) -> int:
    from systolic.workloads.lm.serve.server import serve

    api_key = os.environ.get(API_KEY_ENV) if args.api_key is None else args.api_key
    serve(args.run_dir, host=args.host, port=args.port, api_key=api_key,
          kv_memory_gib=args.kv_memory_gib, page_size=args.page_size, max_seqs=args.max_seqs,
          max_tokens_per_step=args.max_tokens_per_step, max_queue=args.max_queue, prefix_caching=args.prefix_caching,
          mesh_tensor=args.mesh_tensor, kv_cache=args.kv_cache, grace_s=args.grace_s, quantize=args.quantize)
    return 0
