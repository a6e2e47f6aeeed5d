"""`systolic export`: a trained lm as serialized StableHLO (`jax.export`), runnable without systolic's code.

For `--out model.jaxexport` it writes, each file atomically:

    model.jaxexport         the first function asked for (`--what`): forward, or the decode step
    model.decode.jaxexport  the decode step, when both are asked for
    model.params.npz        the parameters: a flat {"blocks.0.attn.wq": array, ...} dict, argument 0 of both
    model.json              what a deployer wants to know (vocabulary, context, KV-cache layout, platforms)

forward:  (params, tokens int32 (B, T)) -> logits float32 (B, T, V); B symbolic, T symbolic up to max_seq_len.
decode:   (params, tokens int32 (B, T), cache) -> (logits float32 (B, T, V), cache), where cache is
          {"k": (L, B, S, KV, hd), "v": (L, B, S, KV, hd), "length": int32 ()}; B, T and S symbolic,
          T <= S <= max_seq_len. T = prompt length for prefill, 1 for a step; `length` counts filled positions.

The parameters are an argument, not baked-in constants, so a large model's module stays under protobuf's size limit
and the caller loads, shards and swaps them (docs/design-notes.md, this module's section). The loader
(docs/debugging.md, `examples/run_exported.py`) needs only jax and numpy.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from systolic import outfile
from systolic.errors import UserError
from systolic.workloads.lm.model.layers import resolve_dtype
from systolic.workloads.lm.model.kv_cache import KVCache
from systolic.workloads.lm.loaded_run import LoadedRun, load_run

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
WHAT = {"forward": ("forward",), "decode": ("decode",), "both": ("forward", "decode")}


def param_names(params: Any) -> list[str]:
    """Dotted names of the parameter leaves, in flattening order: ("blocks", 0, "attn", "wq") -> "blocks.0.attn.wq".
    jax.export serializes only string-keyed dicts, and the model's layer list has integer keys."""
    return [".".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def make_functions(run: LoadedRun) -> dict[str, Any]:
    """forward and decode as functions of (flat params dict, ...) plain arrays, ready for `jax.export`."""
    names = param_names(run.params)
    treedef = jax.tree.structure(run.params)

    def model(flat: dict[str, jax.Array]):
        nested = jax.tree.unflatten(treedef, [flat[name] for name in names])
        return nnx.merge(run.graphdef, nested, copy=True)

    def forward(flat, tokens):
        return model(flat)(tokens)  # (B, T, V)

    def decode(flat, tokens, cache):
        logits, new = model(flat).decode(tokens, KVCache(cache["k"], cache["v"], cache["length"]))  # (B, T, V)
        return logits, {"k": new.k, "v": new.v, "length": new.length}

    return {"forward": forward, "decode": decode}


def export_functions(run: LoadedRun, what: Sequence[str], platforms: Sequence[str]) -> dict[str, jax.export.Exported]:
    """Traces and lowers each function in `what` for `platforms`, with symbolic batch/length dims."""
    mcfg = run.cfg.model
    flat = dict(zip(param_names(run.params), jax.tree.leaves(run.params)))
    params_spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in flat.items()}
    export = {name: jax.export.export(jax.jit(fn), platforms=platforms) for name, fn in make_functions(run).items()}
    exported = {}
    if "forward" in what:
        # The model refuses T > max_seq_len; the constraint lets that check (and positional tables) resolve.
        b, t = jax.export.symbolic_shape("b, t", constraints=(f"t <= {mcfg.max_seq_len}",))
        exported["forward"] = export["forward"](params_spec, jax.ShapeDtypeStruct((b, t), jnp.int32))
    if "decode" in what:
        b, t, s = jax.export.symbolic_shape("b, t, s", constraints=(f"s <= {mcfg.max_seq_len}", "t <= s"))
        if mcfg.mla.kv_lora_rank:  # (L, B, S, r + rope): MLA's latent rows, no values (lm/model/mla.py)
            k = jax.ShapeDtypeStruct((mcfg.layers, b, s, mcfg.mla.cache_width), resolve_dtype(mcfg.dtype))
            v = None
        else:  # (L, B, S, KV, hd) each
            k = v = jax.ShapeDtypeStruct((mcfg.layers, b, s, mcfg.n_kv_heads, mcfg.d_head), resolve_dtype(mcfg.dtype))
        cache = {"k": k, "v": v, "length": jax.ShapeDtypeStruct((), jnp.int32)}
        exported["decode"] = export["decode"](params_spec, jax.ShapeDtypeStruct((b, t), jnp.int32), cache)
    return exported


def export_run(run_dir: Path, out: Path, *, what: str = "forward",
               platforms: Sequence[str] | None = None, force: bool = False) -> list[Path]:
    """Writes the artefacts described in the module docstring; returns their paths (the manifest last)."""
    if what not in WHAT:
        raise UserError(f"--what {what!r}: expected one of {', '.join(WHAT)}.")
    platforms = list(platforms or [jax.export.default_export_platform()])
    unknown = [p for p in platforms if p not in PLATFORMS]
    if unknown or not platforms:
        raise UserError(f"--platforms {','.join(platforms)}: {', '.join(unknown) or 'empty'} is not a platform "
                        f"jax.export targets. Fix: a comma-separated subset of {', '.join(PLATFORMS)}, e.g. "
                        "--platforms cpu,cuda.")
    out = Path(out)
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)  # folders missing are made
    if blocking is not None:
        raise UserError(f"--out {out}: {blocking} is a file, so no folder can hold the export there. Fix: choose "
                        f"another path, e.g. --out {blocking.parent / 'model.jaxexport'}.")
    paths = {name: out if i == 0 else out.with_name(f"{out.stem}.{name}{out.suffix}")
             for i, name in enumerate(WHAT[what])}
    params_path, manifest_path = out.with_name(out.stem + ".params.npz"), out.with_name(out.stem + ".json")
    outfile.check(out, option="--out", suffixes=(".jaxexport",), force=force)
    for path in (*paths.values(), params_path, manifest_path):  # the files written beside it
        outfile.check(path, option="--out", suffixes=(), force=force)
    run = load_run(run_dir, "systolic export")
    run.require_float(run_dir, "systolic export", "the exported functions take float32 parameters")
    exported = export_functions(run, WHAT[what], platforms)
    flat = {k: np.asarray(v) for k, v in zip(param_names(run.params), jax.device_get(jax.tree.leaves(run.params)))}
    buffer = io.BytesIO()
    np.savez(buffer, **flat)
    _write_atomic(params_path, buffer.getvalue())
    for name, exp in exported.items():
        _write_atomic(paths[name], bytes(exp.serialize()))
    manifest = _manifest(run, exported, {name: p.name for name, p in paths.items()}, params_path.name, platforms)
    _write_atomic(manifest_path, json.dumps(manifest, indent=1).encode())
    return [*paths.values(), params_path, manifest_path]


def _manifest(run: LoadedRun, exported: dict[str, jax.export.Exported], files: dict[str, str], params_file: str,
              platforms: Sequence[str]) -> dict[str, Any]:
    mcfg = run.cfg.model
    tokenizer = run.tokenizer
    dtype = str(resolve_dtype(mcfg.dtype))
    return {
        "format": "systolic-jaxexport-1",
        "files": files,
        "params": params_file,
        "signatures": {name: f"{exp.in_avals} -> {exp.out_avals}" for name, exp in exported.items()},
        "platforms": list(platforms),
        "calling_convention_version": next(iter(exported.values())).calling_convention_version,
        "jax_version": jax.__version__,
        "checkpoint_step": run.step,
        "model": {"family": mcfg.family, "vocab": run.vocab, "tokenizer": run.cfg.data.tokenizer,
                  "tokenizer_vocab": tokenizer.vocab_size, "eot_id": tokenizer.eot_id, "max_seq_len": mcfg.max_seq_len,
                  "compute_dtype": dtype},
        "kv_cache": {"shape": ["layers", "batch", "capacity", "kv_heads", "head_dim"], "layers": mcfg.layers,
                     "kv_heads": mcfg.n_kv_heads, "head_dim": mcfg.d_head, "dtype": dtype},
    }


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # `--out exp/model.jaxexport` where exp/ is new
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"Cannot write {path}: {e}. Fix: pass a writable --out path.") from None
