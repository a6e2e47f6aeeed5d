"""Text in, text out: tokenise a prompt (or render a chat conversation), decode with the KV cache, detokenise.
Works from any run directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from flax import nnx

from systolic.data.generation_config import eos_ids
from systolic.data.tokenizer import Tokenizer, make_tokenizer, run_tokenizer
from systolic.data.unicode_text import check_unicode
from systolic.data.chat import find_chat_template
from systolic.engine import finished
from systolic.errors import UserError
from systolic.workloads.lm.config import LMConfig, SampleConfig
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.serve.engine import InferenceEngine, SamplingParams

if TYPE_CHECKING:
    from systolic.data.chat import ChatTemplate


def sample_text(tokenizer: Tokenizer, graphdef: nnx.GraphDef, params: Any, settings: SampleConfig, *,
                kv_cache: str = "auto", fit: bool = False) -> str:
    """The continuation of `settings.prompt` (without the prompt), ended by the end-of-document token or another eos
    id the model declares; the KV cache stores keys and values as `kv_cache` says (kernels/paged_attention/pool.py).
    With `fit`, at most as many new tokens as the model's context leaves after the prompt (instead of an error)."""
    ids = tokenizer.encode(settings.prompt).astype(np.int32)
    if len(ids) == 0:
        ids = np.array([tokenizer.eot_id], np.int32)  # an empty prompt starts a fresh document
    return _continue(graphdef, params, tokenizer, ids, eos_ids(tokenizer), settings, kv_cache, fit)


def chat_reply(graphdef: nnx.GraphDef, params: Any, template: ChatTemplate, settings: SampleConfig, *,
               system: str | None = None, kv_cache: str = "auto", fit: bool = False) -> str:
    """The assistant's reply to the user message `settings.prompt` (after the system message `system`, if any),
    rendered with `template` and ended by its end-of-turn token."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": settings.prompt})
    ids = template.encode(messages, add_generation_prompt=True).astype(np.int32)
    return _continue(graphdef, params, template.tokenizer, ids, template.stop_ids, settings, kv_cache, fit)


def say_sample(say: Callable[[str], None], tokenizer: Tokenizer, graphdef: nnx.GraphDef, params: Any,
               settings: SampleConfig, *, chat: bool, held_out: Any = None) -> None:
    """Prints the end-of-training sample: with `chat` and a chat template beside the tokenizer, the reply to
    `settings.prompt` as a user message, in the template (none without a prompt); otherwise the prompt's
    continuation. An empty prompt takes the opening of the held-out text `held_out` (token ids, documents each
    ended by the end-of-document id), so a model of prose is prompted with prose, and of code with code."""
    template = find_chat_template(tokenizer) if chat else None
    described = f"temperature {settings.temperature}, top-k {settings.top_k}"
    if template is not None:
        if settings.prompt:
            reply = chat_reply(graphdef, params, template, settings, fit=True)
            say(f"sample reply ({described}) to {settings.prompt!r}:\n{reply}")
        return
    if not settings.prompt and held_out is not None:
        # The prompt's share of the context, less one for a start token the encoder may add (Llama's).
        room = nnx.merge(graphdef, params).cfg.max_seq_len - settings.max_new_tokens - 1
        settings = dataclasses.replace(settings, prompt=opening(held_out, tokenizer, max_tokens=max(room, 0)))
        described += ", prompted with the opening of a held-out document"
    say(f"sample ({described}):\n{settings.prompt}{sample_text(tokenizer, graphdef, params, settings, fit=True)}")


def opening(tokens: Any, tokenizer: Tokenizer, max_chars: int = 40, max_tokens: int | None = None) -> str:
    """The first non-blank line of the first document in `tokens` (ids, each document ended by the end-of-document
    id) within its first `max_tokens` ids, cut to at most `max_chars` characters at a space where it is longer; ""
    for an empty document."""
    # Enough ids for max_chars characters under any tokenizer; index arrays work on every kind of token source.
    count = min(4 * max_chars, len(tokens), 4 * max_chars if max_tokens is None else max_tokens)
    head = np.asarray(tokens[np.arange(count)])
    ends = np.flatnonzero(head == tokenizer.eot_id)
    text = tokenizer.decode(head[: ends[0] if len(ends) else len(head)])
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if len(line) <= max_chars:
        return line
    cut = line.rfind(" ", 0, max_chars + 1)
    return line[: cut if cut > 0 else max_chars]


def _continue(graphdef: nnx.GraphDef, params: Any, tokenizer: Tokenizer, ids: np.ndarray, stop_ids: tuple[int, ...],
              settings: SampleConfig, kv_cache: str, fit: bool = False) -> str:
    """The text that the model adds after the prompt `ids`, up to (not including) the first of `stop_ids`: one
    request to the inference engine (lm/serve), which samples what `generate` samples with the same seed. `fit`:
    sample_text's."""
    model = nnx.merge(graphdef, params).cfg  # the model's config travels in its graphdef
    if fit:  # the end-of-training sample: a recipe's sample.max_new_tokens must not fail a run on a short model
        settings = dataclasses.replace(settings, max_new_tokens=max(0, min(settings.max_new_tokens,
                                                                            model.max_seq_len - len(ids))))
    if settings.max_new_tokens == 0:
        return ""
    check_room(len(ids), settings.max_new_tokens, model.max_seq_len)  # before the pool is sized by it
    page_size = 16
    pages = -(-(len(ids) + settings.max_new_tokens - 1) // page_size) + 1  # the request's pages and the null page
    engine = InferenceEngine(model, params, tokenizer, kv_pages=pages, page_size=page_size, max_seqs=1,
                             kv_cache=kv_cache)
    engine.add_request("sample", ids.tolist(), SamplingParams(
        max_tokens=settings.max_new_tokens, temperature=settings.temperature, top_k=settings.top_k,
        top_p=settings.top_p, seed=settings.seed, stop_token_ids=tuple(stop_ids)))
    new = []
    while engine.has_work():
        new += [event.token_id for event in engine.step() if event.token_id not in stop_ids]
    return continuation_text(tokenizer, ids, np.asarray(new, np.int64))


def check_room(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """A UserError when a prompt of `prompt_tokens` and `max_new_tokens` more do not fit the model's `context`."""
    if prompt_tokens + max_new_tokens > context:
        raise UserError(
            f"Cannot generate {max_new_tokens:,} tokens after a prompt of {prompt_tokens:,} tokens: the model attends "
            f"over at most {context:,} positions (model.max_seq_len). Fix: --max-new-tokens "
            f"{max(context - prompt_tokens, 1):,} or less, or a shorter prompt.")


def continuation_text(tokenizer: Tokenizer, prompt_ids: np.ndarray, new_ids: np.ndarray) -> str:
    """The text that `new_ids` add after `prompt_ids`. Decoding the new ids alone can differ: a character split
    across the boundary (bytes, byte-level BPE) or a decoder that strips a leading space (Llama's) would lose text."""
    head = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(np.concatenate([prompt_ids, new_ids]))
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new_ids)


def generate_from_run(run_dir: Path, *, prompt: str | None, max_new_tokens: int | None, temperature: float | None,
                      top_k: int | None, top_p: float | None, seed: int | None, chat: bool = False,
                      system: str | None = None, quantize: str | None = None, kv_cache: str = "auto") -> str:
    """The prompt followed by its continuation; unset arguments take the run's `sample` settings; `quantize` a scheme
    for the weights (lm/model/quant.py), `kv_cache` how the KV cache stores keys and values
    (kernels/paged_attention/pool.py). With `chat`, the assistant's reply alone, to the user message `prompt` after
    the optional system message `system`, rendered with the run's chat template and ended by its end-of-turn token."""
    if system is not None and not chat:
        raise UserError("--system sets the system message of a chat, but --chat is not set, so it would be ignored. "
                        "Fix: add --chat (the run needs a chat template), or drop --system.")
    if chat and prompt is None:
        raise UserError("--chat needs --prompt: it is the user's message that the model replies to. Fix: e.g. "
                        "`systolic generate RUN --chat --prompt \"What is a monad?\"`.")
    if system is not None:
        check_unicode(system, "--system")  # --prompt is sample.prompt, checked with the other sample settings
    command = "systolic generate --chat" if chat else "systolic generate"
    cfg = finished.read_config(run_dir, LMConfig, command)  # the settings checked before the slow part
    overrides = {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                 "top_p": top_p, "seed": seed}
    settings = dataclasses.replace(cfg.sample, **{k: v for k, v in overrides.items() if v is not None})
    settings.validate()
    template = chat_template(run_dir, cfg) if chat else None  # before the checkpoint is read: a run without one fails
    check_room(1, settings.max_new_tokens, cfg.model.max_seq_len)  # any prompt has a token: before the slow part
    run = load_run(run_dir, command, quantize=quantize)
    if template is not None:
        return chat_reply(run.graphdef, run.params, template, settings, system=system, kv_cache=kv_cache)
    return settings.prompt + sample_text(run.tokenizer, run.graphdef, run.params, settings, kv_cache=kv_cache)


def chat_template(run_dir: Path, cfg: LMConfig) -> ChatTemplate:
    """The chat template that the run `run_dir` (config `cfg`) keeps beside its tokenizer.json; a UserError when it
    has none."""
    from systolic.data.chat import CONFIG_FILE, TEMPLATE_FILE

    spec = run_tokenizer(run_dir, cfg.data.tokenizer)
    template = find_chat_template(make_tokenizer(spec))
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
