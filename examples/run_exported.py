"""Runs a language model written by `systolic export` with nothing but jax and numpy (no systolic, no flax).

    systolic export runs/lm-tiny --out model.jaxexport --what both
    python examples/run_exported.py model.jaxexport tokens.npy [more.npy ...] --out logits.npz [--new 20]

Each TOKENS.npy is an int32 array (B, T); batch sizes and lengths may differ between files (the export's batch
and length are symbolic). Writes `logits_<i>` (B, T, V) for each, and with --new N also `generated_<i>` (B, N),
the greedy continuation decoded with the KV cache (model.decode.jaxexport), and `decode_logits_<i>` (B, N, V).
"""

import argparse
import glob
import os
import time
from importlib import metadata, util
from pathlib import Path


def only_cpu_can_start() -> bool:
    """Whether this host can run nothing but the CPU: no TPU device files (/dev/accel*, /dev/vfio/N) and no GPU plugin
    for jax. libtpu, when installed on such a host, prints warnings about TPU worker hostnames and accelerator types
    as jax starts, and then jax runs on the CPU anyway."""
    tpu = glob.glob("/dev/accel*") or [p for p in glob.glob("/dev/vfio/*") if not p.endswith("/vfio")]
    gpu = list(metadata.entry_points(group="jax_plugins")) or util.find_spec("jax_plugins") is not None
    return not tpu and not gpu


if "JAX_PLATFORMS" not in os.environ and only_cpu_can_start():
    os.environ["JAX_PLATFORMS"] = "cpu"  # before jax starts: it skips the TPU plugin and its start-up noise

import jax  # noqa: E402  (after JAX_PLATFORMS)
import numpy as np  # noqa: E402


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
    start = time.perf_counter()
    for i, path in enumerate(args.tokens):
        tokens = np.load(path).astype(np.int32)  # (B, T)
        results[f"logits_{i}"] = np.asarray(forward(params, tokens))  # (B, T, V)
        if decode is not None:
            results[f"generated_{i}"], results[f"decode_logits_{i}"] = greedy(decode, params, tokens, args.new)
    np.savez(args.out, **results)
    arrays = ", ".join(f"{name} {tuple(value.shape)}" for name, value in results.items())
    print(f"wrote {args.out}: {arrays}; {time.perf_counter() - start:.1f} s on {jax.default_backend()}")


if __name__ == "__main__":
    main()
