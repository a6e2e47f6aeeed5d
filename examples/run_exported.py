"""Runs a language model written by `systolic export` with nothing but jax and numpy (no systolic, no flax).

    systolic export runs/lm-tiny --out model.jaxexport --what both
    python examples/run_exported.py model.jaxexport tokens.npy [more.npy ...] --out logits.npz [--new 20]

Each TOKENS.npy is an int32 array (B, T); batch sizes and lengths may differ between files (the export's batch
and length are symbolic). Writes `logits_<i>` (B, T, V) for each, and with --new N also `generated_<i>` (B, N),
the greedy continuation decoded with the KV cache (model.decode.jaxexport), and `decode_logits_<i>` (B, N, V).
"""

import argparse
from pathlib import Path

import jax
import numpy as np


def load(path: Path) -> jax.export.Exported:
    return jax.export.deserialize(bytearray(path.read_bytes()))


def greedy(decode: jax.export.Exported, params: dict, prompt: np.ndarray, new: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding: one prefill of the prompt (B, P), then one call per new token; (tokens, logits) out."""
    step = jax.jit(decode.call)  # compiled once per shape: prefill (B, P) and step (B, 1)
    k = decode.in_avals[-3]  # the cache's k: (L, B, S, KV, hd) with B and S symbolic
    shape = (k.shape[0], prompt.shape[0], prompt.shape[1] + new, k.shape[3], k.shape[4])
    cache = {"k": np.zeros(shape, k.dtype), "v": np.zeros(shape, k.dtype), "length": np.int32(0)}
    logits, cache = step(params, prompt, cache)  # (B, P, V)
    tokens, all_logits = [], []
    for _ in range(new):
        all_logits.append(np.asarray(logits[:, -1]))  # (B, V)
        tokens.append(np.argmax(all_logits[-1], axis=-1).astype(np.int32))  # (B,)
        logits, cache = step(params, tokens[-1][:, None], cache)  # (B, 1, V)
    return np.stack(tokens, axis=1), np.stack(all_logits, axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="the .jaxexport file of the forward pass")
    parser.add_argument("tokens", type=Path, nargs="+", help=".npy files of int32 token ids (B, T)")
    parser.add_argument("--out", type=Path, required=True, help=".npz to write")
    parser.add_argument("--new", type=int, default=0, help="greedy-decode this many tokens after each prompt")
    args = parser.parse_args()
    forward = jax.jit(load(args.model).call)
    params = dict(np.load(args.model.with_name(args.model.stem + ".params.npz")))  # {name: array}
    decode = load(args.model.with_name(f"{args.model.stem}.decode{args.model.suffix}")) if args.new else None
    results = {}
    for i, path in enumerate(args.tokens):
        tokens = np.load(path).astype(np.int32)  # (B, T)
        results[f"logits_{i}"] = np.asarray(forward(params, tokens))  # (B, T, V)
        if decode is not None:
            results[f"generated_{i}"], results[f"decode_logits_{i}"] = greedy(decode, params, tokens, args.new)
    np.savez(args.out, **results)


if __name__ == "__main__":
    main()
