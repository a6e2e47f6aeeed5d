"""Text in, text out: tokenise a prompt, decode with the KV cache, detokenise. Works from any run directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from systolic.data.tokenizer import Tokenizer, make_tokenizer, run_tokenizer
from systolic.engine import finished
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.generate import generate


def sample_text(cfg: LMConfig, graphdef: nnx.GraphDef, params: Any, vocab: int, *, prompt: str,
                max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int) -> str:
    tokenizer = make_tokenizer(cfg.data.tokenizer)
    ids = tokenizer.encode(prompt).astype(np.int32)
    if len(ids) == 0:
        ids = np.array([tokenizer.eot_id], np.int32)  # an empty prompt starts a fresh document
    new = generate(graphdef, params, ids[None, :], max_new_tokens=max_new_tokens, temperature=temperature,
                   top_k=top_k, top_p=top_p, key=jax.random.PRNGKey(seed), vocab_limit=tokenizer.vocab_size)
    new = np.asarray(jax.device_get(new))[0]
    stop = np.flatnonzero(new == tokenizer.eot_id)
    if stop.size:
        new = new[: stop[0]]
    return continuation_text(tokenizer, ids, new)


def continuation_text(tokenizer: Tokenizer, prompt_ids: np.ndarray, new_ids: np.ndarray) -> str:
    """The text that `new_ids` add after `prompt_ids`. Decoding the new ids alone can differ: a character split
    across the boundary (bytes, byte-level BPE) or a decoder that strips a leading space (Llama's) would lose text."""
    head = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(np.concatenate([prompt_ids, new_ids]))
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new_ids)


def generate_from_run(run_dir: Path, *, prompt: str | None, max_new_tokens: int | None, temperature: float | None,
                      top_k: int | None, top_p: float | None, seed: int | None) -> str:
    """The prompt followed by its continuation; unset arguments take the run's `sample` settings."""
    command = "systolic generate"
    cfg = finished.read_config(run_dir, "lm", command)  # the settings checked before the slow part
    overrides = {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                 "top_p": top_p, "seed": seed}
    settings = dataclasses.replace(cfg.sample, **{k: v for k, v in overrides.items() if v is not None})
    settings.validate()
    run = load_run(run_dir, command)
    cfg, graphdef, params, vocab = run.cfg, run.graphdef, run.params, run.vocab
    return settings.prompt + sample_text(cfg, graphdef, params, vocab, prompt=settings.prompt, max_new_tokens=settings.max_new_tokens,
                       temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p, seed=settings.seed)


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """A trained lm run's model on one device: what `generate` and `export` start from."""

    cfg: LMConfig
    vocab: int  # embedding rows (the tokenizer's vocabulary, padded)
    graphdef: nnx.GraphDef
    params: Any  # pure dict of arrays, on the first device
    step: int  # the checkpoint's step


def load_run(run_dir: Path, command: str) -> LoadedRun:
    """The newest intact checkpoint's parameters and the run's config, with the run's own tokenizer; `command`
    ("systolic export") names what the user ran in the errors."""
    from systolic.workloads.lm.train import model_graphdef

    with finished.open_run(run_dir, "lm", command) as run:
        cfg: LMConfig = run.cfg
        # The run's own copy of its tokenizer, not data.tokenizer's original path (relative to another folder, or gone).
        tokenizer = run_tokenizer(run_dir, cfg.data.tokenizer)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
        vocab = cfg.model.padded_vocab(make_tokenizer(cfg.data.tokenizer).vocab_size)
        graphdef = model_graphdef(cfg.model, vocab)
        abstract = nnx.eval_shape(lambda: nnx.to_pure_dict(nnx.state(_model(cfg, vocab), nnx.Param)))
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
        params = run.restore_params(abstract)
    return LoadedRun(cfg=cfg, vocab=vocab, graphdef=graphdef, params=params, step=run.step)


def _model(cfg: LMConfig, vocab: int):
    from systolic.workloads.lm.model import Transformer

    return Transformer(cfg.model, vocab, rngs=nnx.Rngs(0))
