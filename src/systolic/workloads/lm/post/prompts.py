"""GRPO's prompts (lm objective=grpo): .jsonl records -> the token ids the policy continues and the fields its rewards
read.

`data.path` is a .jsonl file (or .jsonl.gz, or a folder of them read in name order); each line is one record:

- `{"prompt": "What is 17 + 25?", "answer": "42"}`: plain text the policy continues as it is (the tokenizer's
  post-processor adds what it adds, as for SFT's prompts); a completion ends at the end-of-document id or any eos
  id the model declares (data/generation_config.py).
- `{"messages": [{"role": "user", "content": "What is 17 + 25?"}], "answer": "42"}`: a conversation rendered with
  the chat template kept beside the run's tokenizer.json, with its generation prompt (the assistant's header); a
  completion ends at one of the template's stop ids (`ChatTemplate.stop_ids`).

Every other field of a record (`answer` above) reaches the reward functions as `fields`, with the prompt's text (the
string, or the rendered conversation) and the completion's. Each prompt is named `file:line` and held out for
evaluation by the stable hash of its name (data.val_percent), as SFT's examples are (`corpus.held_out`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from systolic.data import corpus
from systolic.data.generation_config import eos_ids
from systolic.data.sft import read_records
from systolic.data.tokenizer import Tokenizer
from systolic.data.chat import LazyTemplate
from systolic.errors import UserError

EXAMPLE = ('{"prompt": "What is 17 + 25?", "answer": "42"} or {"messages": [{"role": "user", "content": '
           '"What is 17 + 25?"}], "answer": "42"}')


@dataclasses.dataclass(frozen=True)
class Prompt:
    name: str  # file:line
    text: str  # what the rewards see as the prompt: the string, or the rendered conversation
    ids: np.ndarray  # (P,) int32, P >= 1
    fields: dict[str, Any]  # the record without its prompt or messages
    stop_ids: tuple[int, ...]  # the ids that end a completion


@dataclasses.dataclass(frozen=True)
class PromptSet:
    train: tuple[Prompt, ...]
    val: tuple[Prompt, ...]

    def describe(self) -> str:
        """One line for the start of a run."""
        longest = max(len(p.ids) for p in (*self.train, *self.val))
        return f"{len(self.train):,} train / {len(self.val):,} held-out prompts, the longest {longest} tokens"


def load_prompts(path: str, tokenizer: Tokenizer, *, max_prompt_len: int, val_percent: float) -> PromptSet:
    """Reads and encodes the prompt records at `path`; a UserError naming the file and line of the first bad one
    (no prompt, not text, empty, longer than `max_prompt_len` tokens), so nothing starts on bad data."""
    encoder = _Encoder(tokenizer, max_prompt_len)
    records = read_records(path, EXAMPLE, reader="objective=grpo")
    prompts = [encoder.encode(name, where, record) for name, where, record in records]
    if len(prompts) < 2:
        raise UserError(
            f"data.path={path!r} holds {len(prompts)} prompt record(s): too few to train on and hold some out for "
            f"evaluation. Expected one JSON record per line, e.g. {EXAMPLE}. Fix: point data.path at more records."
        )
    is_val = corpus.held_out([p.name for p in prompts], val_percent)
    return PromptSet(train=tuple(p for p, v in zip(prompts, is_val, strict=True) if not v),
                     val=tuple(p for p, v in zip(prompts, is_val, strict=True) if v))


class _Encoder:
    """A record -> its Prompt; the chat template is looked up on the first conversation."""

    def __init__(self, tokenizer: Tokenizer, max_prompt_len: int):
        self.tokenizer, self.max_prompt_len = tokenizer, max_prompt_len
        self._template_for = LazyTemplate(
            tokenizer, "a conversation (`messages`)",
            "post-train a model whose run keeps its template (imported by `systolic convert from-hf`), or write the "
            "records as {\"prompt\": \"...\"} text.")

    def encode(self, name: str, where: str, record: dict[str, Any]) -> Prompt:
        has_messages, has_prompt = "messages" in record, "prompt" in record
        if has_messages == has_prompt:
            problem = "has both `messages` and `prompt`" if has_messages else "has neither `prompt` nor `messages`"
            raise _bad_record(where, f"{problem} (its keys: {sorted(record)}); a record holds one prompt")
        fields = {k: v for k, v in record.items() if k not in ("prompt", "messages")}
        if has_prompt:
            text = record["prompt"]
            if not isinstance(text, str):
                raise _bad_record(where, f"has a `prompt` that is a JSON {type(text).__name__}, not a string")
            ids, stop_ids = self.tokenizer.encode(text), eos_ids(self.tokenizer)
        else:
            text, ids, stop_ids = self._conversation(record["messages"], where)
        if not 0 < len(ids) <= self.max_prompt_len:
            raise _bad_record(where, f"has a prompt of {len(ids)} tokens, but a prompt needs 1 to "
                                     f"{self.max_prompt_len} (data.seq_len minus grpo.max_completion_len: a row holds "
                                     "the prompt and its completion). Shorten it, or raise data.seq_len (and "
                                     "model.max_seq_len)")
        return Prompt(name, text, np.asarray(ids, np.int32), fields, tuple(stop_ids))

    def _conversation(self, messages: Any, where: str) -> tuple[str, np.ndarray, tuple[int, ...]]:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise _bad_record(where, "has `messages` that are not a non-empty list of objects with a string `role`")
        template = self._template_for(where)
        try:
            text = template.render(messages, add_generation_prompt=True)
        except UserError as error:  # the template refused this conversation: say which one
            raise UserError(f"{where}: {error}") from None
        return text, template.tokenizer.encode_with_specials(text)[0], template.stop_ids


def _bad_record(where: str, problem: str) -> UserError:
    return UserError(f"{where} {problem}. Expected one JSON object per line, e.g. {EXAMPLE}. Fix: repair or remove "
                     "that line.")
