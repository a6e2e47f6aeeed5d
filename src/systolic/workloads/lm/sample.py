"""Text in, text out: tokenise a prompt, decode with the KV cache, detokenise. Works from any run directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from systolic.config import MeshConfig
from systolic.data.tokenizer import Tokenizer, make_tokenizer, run_tokenizer
from systolic.engine import finished
from systolic.errors import ConfigError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import Rules, rules_for, with_shardings
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
    """A trained lm run's model: what `generate`, `export` and `eval` start from."""

    cfg: LMConfig
    vocab: int  # embedding rows (the tokenizer's vocabulary, padded)
    graphdef: nnx.GraphDef
    params: Any  # pure dict of arrays: on the first device, or laid out on `mesh` by `rules`
    step: int  # the checkpoint's step
    mesh: jax.sharding.Mesh | None = None  # None: the parameters sit on the first device
    rules: Rules | None = None
    layout: str = "one device"  # which mesh, and why: for reports


def load_run(run_dir: Path, command: str, *, sharded: bool = False,
             devices: list[jax.Device] | None = None) -> LoadedRun:
    """The newest intact checkpoint's parameters and the run's config, with the run's own tokenizer; `command`
    ("systolic export") names what the user ran in the errors. `sharded`: the parameters laid out over `devices`
    (default: all) as `sharded_layout` chooses; otherwise on the first device."""
    from systolic.workloads.lm.train import model_graphdef, param_shardings

    with finished.open_run(run_dir, "lm", command) as run:
        cfg: LMConfig = run.cfg
        # The run's own copy of its tokenizer, not data.tokenizer's original path (relative to another folder, or gone).
        tokenizer = run_tokenizer(run_dir, cfg.data.tokenizer)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
        vocab = cfg.model.padded_vocab(make_tokenizer(cfg.data.tokenizer).vocab_size)
        graphdef = model_graphdef(cfg.model, vocab)
        abstract = nnx.eval_shape(lambda: nnx.to_pure_dict(nnx.state(_model(cfg, vocab), nnx.Param)))
        mesh, rules, layout = None, None, "one device"
        if sharded:
            mesh, rules, layout = sharded_layout(cfg, vocab, jax.devices() if devices is None else devices)
            shardings = param_shardings(cfg.model, vocab, mesh, rules)
        else:
            shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
        params = run.restore_params(with_shardings(abstract, shardings))
    return LoadedRun(cfg=cfg, vocab=vocab, graphdef=graphdef, params=params, step=run.step, mesh=mesh, rules=rules,
                     layout=layout)


def sharded_layout(cfg: LMConfig, vocab: int, devices: list[jax.Device]) -> tuple[jax.sharding.Mesh, Rules, str]:
    """The run's own mesh and sharding rules when they fit `devices` (a different count, or sizes that do not
    divide, do not); otherwise every device data-parallel with the parameters replicated, which fits any count.
    Returns (mesh, rules, a description for reports)."""
    from systolic.workloads.lm.train import param_shardings

    try:
        mesh = mesh_lib.make_mesh(cfg.mesh, devices)
        rules = rules_for(cfg.sharding.rules, mesh)
        param_shardings(cfg.model, vocab, mesh, rules)  # a ConfigError when a dimension does not divide
        return mesh, rules, f"mesh {mesh_lib.describe(mesh)} (the run's, sharding.rules={cfg.sharding.rules})"
    except ConfigError:
        mesh = mesh_lib.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1), devices)
        m = cfg.mesh
        return mesh, rules_for("dp", mesh), (
            f"mesh {mesh_lib.describe(mesh)} (every device data-parallel: the run's mesh data={m.data} fsdp={m.fsdp} "
            f"tensor={m.tensor} does not fit these {len(devices)} device(s))")


def _model(cfg: LMConfig, vocab: int):
    from systolic.workloads.lm.model import Transformer

    return Transformer(cfg.model, vocab, rngs=nnx.Rngs(0))
