"""Text in, text out: tokenise a prompt (or render a chat conversation), decode with the KV cache, detokenise.
Works from any run directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from systolic.config import MeshConfig
from systolic.data.tokenizer import Tokenizer, find_chat_template, make_tokenizer, run_tokenizer
from systolic.engine import finished
from systolic.errors import ConfigError, UserError
from systolic.runtime import memory
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import Rules, rules_for, with_shardings
from systolic.workloads.lm.model import sizes
from systolic.workloads.lm.config import LMConfig, SampleConfig
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams

if TYPE_CHECKING:
    from systolic.data.chat import ChatTemplate


def sample_text(cfg: LMConfig, graphdef: nnx.GraphDef, params: Any, settings: SampleConfig) -> str:
    """The continuation of `settings.prompt` (without the prompt), ended by the end-of-document token."""
    tokenizer = make_tokenizer(cfg.data.tokenizer)
    ids = tokenizer.encode(settings.prompt).astype(np.int32)
    if len(ids) == 0:
        ids = np.array([tokenizer.eot_id], np.int32)  # an empty prompt starts a fresh document
    return _continue(graphdef, params, tokenizer, ids, (tokenizer.eot_id,), settings)


def chat_reply(graphdef: nnx.GraphDef, params: Any, template: ChatTemplate, settings: SampleConfig, *,
               system: str | None = None) -> str:
    """The assistant's reply to the user message `settings.prompt` (after the system message `system`, if any),
    rendered with `template` and ended by its end-of-turn token."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": settings.prompt})
    ids = template.encode(messages, add_generation_prompt=True).astype(np.int32)
    return _continue(graphdef, params, template.tokenizer, ids, template.stop_ids, settings)


def _continue(graphdef: nnx.GraphDef, params: Any, tokenizer: Tokenizer, ids: np.ndarray, stop_ids: tuple[int, ...],
              settings: SampleConfig) -> str:
    """The text that the model adds after the prompt `ids`, up to (not including) the first of `stop_ids`: one
    request to the inference engine (lm/serve), which samples what `generate` samples with the same seed."""
    if settings.max_new_tokens == 0:
        return ""
    model = nnx.merge(graphdef, params).cfg  # the model's config travels in its graphdef
    page_size = 16
    pages = -(-(len(ids) + settings.max_new_tokens - 1) // page_size) + 1  # the request's pages and the null page
    engine = InferenceEngine(model, params, tokenizer, kv_pages=pages, page_size=page_size, max_seqs=1)
    engine.add_request("sample", ids.tolist(), SamplingParams(
        max_tokens=settings.max_new_tokens, temperature=settings.temperature, top_k=settings.top_k,
        top_p=settings.top_p, seed=settings.seed, stop_token_ids=tuple(stop_ids)))
    new = []
    while engine.has_work():
        new += [event.token_id for event in engine.step() if event.token_id not in stop_ids]
    return continuation_text(tokenizer, ids, np.asarray(new, np.int64))


def continuation_text(tokenizer: Tokenizer, prompt_ids: np.ndarray, new_ids: np.ndarray) -> str:
    """The text that `new_ids` add after `prompt_ids`. Decoding the new ids alone can differ: a character split
    across the boundary (bytes, byte-level BPE) or a decoder that strips a leading space (Llama's) would lose text."""
    head = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(np.concatenate([prompt_ids, new_ids]))
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new_ids)


def generate_from_run(run_dir: Path, *, prompt: str | None, max_new_tokens: int | None, temperature: float | None,
                      top_k: int | None, top_p: float | None, seed: int | None, chat: bool = False,
                      system: str | None = None) -> str:
    """The prompt followed by its continuation; unset arguments take the run's `sample` settings. With `chat`, the
    assistant's reply alone, to the user message `prompt` after the optional system message `system`, rendered
    with the run's chat template and ended by its end-of-turn token."""
    if system is not None and not chat:
        raise UserError("--system sets the system message of a chat, but --chat is not set, so it would be ignored. "
                        "Fix: add --chat (the run needs a chat template), or drop --system.")
    if chat and prompt is None:
        raise UserError("--chat needs --prompt: it is the user's message that the model replies to. Fix: e.g. "
                        "`systolic generate RUN --chat --prompt \"What is a monad?\"`.")
    command = "systolic generate --chat" if chat else "systolic generate"
    cfg = finished.read_config(run_dir, "lm", command)  # the settings checked before the slow part
    overrides = {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                 "top_p": top_p, "seed": seed}
    settings = dataclasses.replace(cfg.sample, **{k: v for k, v in overrides.items() if v is not None})
    settings.validate()
    if chat:
        template = chat_template(run_dir, cfg)
        run = load_run(run_dir, command)
        return chat_reply(run.graphdef, run.params, template, settings, system=system)
    run = load_run(run_dir, command)
    return settings.prompt + sample_text(run.cfg, run.graphdef, run.params, settings)


def chat_template(run_dir: Path, cfg: LMConfig) -> ChatTemplate:
    """The chat template that the run `run_dir` (config `cfg`) keeps beside its tokenizer.json; a UserError when it
    has none."""
    from systolic.data.chat import CONFIG_FILE, TEMPLATE_FILE

    spec = run_tokenizer(run_dir, cfg.data.tokenizer)
    template = find_chat_template(spec)
    if template is None:
        lacks = ("uses the byte tokenizer" if spec == "byte" else
                 f"has no {TEMPLATE_FILE}, and no `chat_template` entry in a {CONFIG_FILE}, beside its tokenizer.json")
        raise UserError(
            f"{run_dir} has no chat template (it {lacks}), so --chat cannot write the conversation in the format its "
            "model was trained on. Fix: drop --chat to continue plain text; or import an instruction-tuned model "
            f"whose Hugging Face folder has its chat template with `systolic convert from-hf`; or copy the model's "
            f"{TEMPLATE_FILE} and {CONFIG_FILE} into {run_dir}."
        )
    return template


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
             devices: list[jax.Device] | None = None,
             layout: tuple[jax.sharding.Mesh, Rules] | None = None) -> LoadedRun:
    """The newest intact checkpoint's parameters and the run's config, with the run's own tokenizer; `command`
    ("systolic export") names what the user ran in the errors. `sharded`: the parameters laid out over `devices`
    (default: all) as `sharded_layout` chooses; `layout`: on that (mesh, rules) (the inference engine's tensor
    parallelism); otherwise on the first device. A LoRA run comes back merged: its base (from its init.from) with
    the adapters folded in, and `cfg.model.lora` off."""
    from systolic.workloads.lm.init_from import run_params
    from systolic.workloads.lm.model.lora import base_config
    from systolic.workloads.lm.train import model_graphdef, param_shardings

    with finished.open_run(run_dir, "lm", command) as run:
        cfg: LMConfig = run.cfg
        # The run's own copy of its tokenizer, not data.tokenizer's original path (relative to another folder, or gone).
        tokenizer = run_tokenizer(run_dir, cfg.data.tokenizer)
        cfg = dataclasses.replace(cfg, model=base_config(cfg.model),
                                  data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
        vocab = cfg.model.padded_vocab(make_tokenizer(cfg.data.tokenizer).vocab_size)
        count = sizes.param_count(cfg.model, vocab)  # before tracing: config.yaml may have been edited
        if layout is not None:
            devices, sharded = list(layout[0].devices.flat), True
        memory.check_fits(4 * count, (jax.devices() if devices is None else devices) if sharded else jax.devices()[:1],
                          what=f"{run_dir}'s model ({count:,} float32 parameters, from its config.yaml)",
                          fix=f"check {run_dir}/config.yaml against the run's checkpoint, or use a machine with more memory.")
        graphdef = model_graphdef(cfg.model, vocab)
        abstract = nnx.eval_shape(lambda: nnx.to_pure_dict(nnx.state(_model(cfg, vocab), nnx.Param)))
        mesh, rules, layout_text = None, None, "one device"
        if layout is not None:
            (mesh, rules), layout_text = layout, f"mesh {mesh_lib.describe(layout[0])}"
            shardings = param_shardings(cfg.model, vocab, mesh, rules)
        elif sharded:
            mesh, rules, layout_text = sharded_layout(cfg, vocab, jax.devices() if devices is None else devices)
            shardings = param_shardings(cfg.model, vocab, mesh, rules)
        else:
            shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
        params = run_params(run, with_shardings(abstract, shardings))
    return LoadedRun(cfg=cfg, vocab=vocab, graphdef=graphdef, params=params, step=run.step, mesh=mesh, rules=rules,
                     layout=layout_text)


def sharded_layout(cfg: LMConfig, vocab: int, devices: list[jax.Device]) -> tuple[jax.sharding.Mesh, Rules, str]:
    """The run's own mesh and sharding rules when they fit `devices` (a different count, or sizes that do not
    divide, do not; nor does a mesh that splits sequences over mesh.context, as scored texts and choices have any
    length); otherwise every device data-parallel with the parameters replicated, which fits any count.
    Returns (mesh, rules, a description for reports)."""
    from systolic.workloads.lm.train import param_shardings

    if cfg.mesh.context != 1:  # scoring rows and choices of any length: the sequence stays whole
        mesh = mesh_lib.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1), devices)
        return mesh, rules_for("dp", mesh), (
            f"mesh {mesh_lib.describe(mesh)} (every device data-parallel: the run split its sequences over "
            f"mesh.context={cfg.mesh.context}, which is for training)")
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
    from systolic.workloads.lm.model.transformer import Transformer

    return Transformer(cfg.model, vocab, rngs=nnx.Rngs(0))
