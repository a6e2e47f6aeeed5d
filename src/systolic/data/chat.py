"""Chat templates: a conversation -> the prompt text and token ids a chat model was trained on, as transformers'
`apply_chat_template` makes them, and the assistant mask that supervised fine-tuning trains on.

A model's template comes as chat_template.jinja (transformers 5) or tokenizer_config.json's `chat_template` entry
(earlier versions), and the special tokens it reads are named in tokenizer_config.json (or an old folder's
special_tokens_map.json); a run keeps these files beside its own tokenizer.json
(`systolic.data.tokenizer.COMPANION_FILES`). Rendering follows transformers, in Jinja2's immutable sandbox under a
budget of time, memory, output and recursion (data/template_sandbox.py), since templates from the Hub are untrusted
code; a template that breaks the budget is refused. The text is tokenized with special tokens matched and none
added, so the ids equal `apply_chat_template(..., tokenize=True)` (tests/data/test_chat.py checks both).

The assistant mask marks each assistant message from just after its header through the end-of-turn token the
template writes after it. The spans come from rendering the conversation incrementally (so a template that rewrites
earlier turns is an error), or from the template's own `{% generation %}` blocks. The rendering options and the
mask's exact rules: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np

from systolic.data import template_sandbox
from systolic.data.generation_config import eos_ids
from systolic.data.template_sandbox import CLOSE, OPEN, TemplateFailed
from systolic.data.tokenizer import RUN_FILE, ByteTokenizer, Tokenizer, tokenizer_file
from systolic.errors import UserError

if TYPE_CHECKING:  # the Rust tokenizer library is imported by whoever makes the tokenizer
    from systolic.data.bpe import BPETokenizer

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"

Message = Mapping[str, Any]  # {"role": "user", "content": "..."}; other keys (tool_calls, ...) reach the template too

# A rendering may write this many characters plus OUTPUT_PER_INPUT_CHAR per character of the conversation (as
# JSON): room for any real template's markup and default system text, and a bound on what the tokenizer is given.
OUTPUT_BASE_CHARS = 1 << 20
OUTPUT_PER_INPUT_CHAR = 4
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplate:
    """A model's chat template, the special tokens it reads, and the tokenizer its text is meant for."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], tokenizer: BPETokenizer,
                 where: str = "(given as a string)"):
        self.source = source
        self.special_tokens = dict(special_tokens)  # template variables: bos_token, eos_token, ...
        self.tokenizer = tokenizer
        self.where = where  # the file it came from, for errors
        try:
            template_sandbox.check_syntax(source)
        except RecursionError:  # Jinja's parser recurses once per level of nesting
            raise UserError(f"The chat template {where} nests its blocks or expressions too deeply to parse. Fix: "
                            "restore the model's own template file.") from None
        except jinja2.TemplateSyntaxError as e:
            raise UserError(
                f"The chat template {where} is not a valid Jinja template: {e.message} (line {e.lineno}). Expected "
                "the template a Hugging Face model ships (chat_template.jinja, or `chat_template` in "
                "tokenizer_config.json). Fix: restore the model's own template file."
            ) from None
        self.marks_generation = bool(_GENERATION_TAG.search(source))

    @classmethod
    def load(cls, folder: Path, tokenizer: BPETokenizer) -> ChatTemplate | None:
        """The template kept in `folder` beside a tokenizer.json (chat_template.jinja, else tokenizer_config.json's
        `chat_template`, as transformers prefers them), or None when there is none."""
        folder = Path(folder)
        config = _read_json(folder / CONFIG_FILE)
        if (folder / TEMPLATE_FILE).is_file():
            source, where = _read_template(folder / TEMPLATE_FILE), folder / TEMPLATE_FILE
        else:
            source, where = _config_template(config, folder / CONFIG_FILE), folder / CONFIG_FILE
        if source is None:
            return None
        return cls(source, template_tokens(config, _read_json(folder / SPECIAL_TOKENS_FILE)), tokenizer, str(where))

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
        """The text of `messages`, as `apply_chat_template(messages, tokenize=False)` writes it; with
        add_generation_prompt, followed by the header that starts the assistant's reply."""
        return self._render(messages, [(len(messages), add_generation_prompt, False)])[0]

    def encode(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> np.ndarray:
        """Token ids of `render(...)`, as `apply_chat_template(messages, tokenize=True)` gives them."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode_with_specials(text)[0]

    def encode_with_mask(self, messages: Sequence[Message]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the conversation and a bool mask of the same length, True on assistant tokens (the rule
        is in the module docstring): what supervised fine-tuning computes its loss on."""
        text, spans = self.assistant_spans(messages)
        ids, offsets = self.tokenizer.encode_with_specials(text)
        mask = np.zeros(len(ids), bool)
        for start, end in spans:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        return ids, mask

    def assistant_spans(self, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the [start, end) characters of its assistant turns."""
        if self.marks_generation:
            return self._generation_spans(messages)
        turns = [i for i, message in enumerate(_plain_messages(messages)) if message.get("role") == "assistant"]
        # One request: the whole conversation, then for each assistant turn the text before it with the
        # generation prompt and the text through it.
        text, *renders = self._render(messages, [(len(messages), False, False)] + [
            job for i in turns for job in ((i, True, False), (i + 1, False, False))])
        spans = []
        for i, header, turn in zip(turns, renders[::2], renders[1::2]):
            if not (turn.startswith(header) and text.startswith(turn)):
                raise UserError(
                    f"The chat template {self.where} renders the conversation differently depending on what follows "
                    f"(message {i}, an assistant turn, does not extend the text before it, or later turns change "
                    "it), so the assistant's tokens cannot be located by rendering it turn by turn. Fix: use a "
                    "template that wraps assistant text in {% generation %} ... {% endgeneration %}, as TRL's "
                    "assistant-only loss expects."
                )
            spans.append((len(header), max(len(header), len(turn.rstrip()))))
        return text, spans

    @functools.cached_property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant reply: the special token the template writes right after an assistant
        message (ChatML's <|im_end|>, Llama 3's <|eot_id|>), the `eos_token`, the tokenizer's end of document and the
        eos ids the model declares (`generation_config.eos_ids`)."""
        ids = set(eos_ids(self.tokenizer))
        eos = self.tokenizer.token_id(self.special_tokens.get("eos_token", ""))
        if eos is not None:
            ids.add(eos)
        reply = "Hello."
        try:
            text = self.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}])
        except UserError:  # a template with rules this probe breaks: the eos token alone
            text = ""
        if reply in text:
            after, _ = self.tokenizer.encode_with_specials(text[text.rindex(reply) + len(reply):].lstrip())
            if len(after) and int(after[0]) in self.tokenizer.special_tokens.values():
                ids.add(int(after[0]))
        return tuple(sorted(ids))

    def check(self) -> None:
        """Renders a two-turn conversation, so that a template that breaks its budget (template_sandbox.py) is
        refused when a run takes it (an import, a post-training run, a server's start), not on the first
        conversation. A template whose rules refuse this conversation passes: the conversations it is given
        decide."""
        try:
            self.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}])
            self.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        except _OverBudget:
            raise
        except UserError:
            pass

    def _render(self, messages: Sequence[Message], jobs: list[tuple[int, bool, bool]]) -> list[str]:
        """The texts of `jobs`, each (how many of the messages, add_generation_prompt, mark generation blocks), in
        one request to the sandbox's worker."""
        messages = _plain_messages(messages)
        try:
            size = len(json.dumps(messages, ensure_ascii=False))
        except (TypeError, ValueError) as e:  # a value that JSON cannot carry to the worker
            raise UserError(f"A conversation must hold JSON values only, but {e}. Fix: pass strings, numbers, lists "
                            "and objects.") from None
        try:
            return template_sandbox.render(
                self.source, self.special_tokens, [(messages[:n], prompt, mark) for n, prompt, mark in jobs],
                max_chars=OUTPUT_BASE_CHARS + OUTPUT_PER_INPUT_CHAR * size)
        except TemplateFailed as e:
            if e.over_budget:
                raise _OverBudget(
                    f"The chat template {self.where} was stopped: {e}. A chat template only lays out messages; one "
                    f"that runs longer than {template_sandbox.TIME_BUDGET_S:g} s, writes more than "
                    f"{OUTPUT_BASE_CHARS:,} characters plus {OUTPUT_PER_INPUT_CHAR} per character of the "
                    f"conversation, recurses without end or needs over {template_sandbox.WORKER_MEMORY_BYTES >> 30} GiB "
                    "is broken or hostile. Fix: restore the model's own template (chat_template.jinja, or "
                    "`chat_template` in tokenizer_config.json)."
                ) from None
            raise UserError(
                f"The chat template {self.where} failed on this conversation: {e}. Templates raise when a "
                "conversation breaks their rules (roles that do not alternate user/assistant, a system message "
                "where none is allowed) or reads something the conversation lacks. Fix: change the conversation to "
                "follow the rule named above."
            ) from None

    def _generation_spans(self, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
        marked, plain = self._render(messages, [(len(messages), False, True), (len(messages), False, False)])
        parts, spans, length, start = [], [], 0, None
        for piece in re.split(f"([{OPEN}{CLOSE}])", marked):
            if piece == OPEN and start is None:
                start = length
            elif piece == CLOSE and start is not None:
                spans.append((start, length))
                start = None
            elif piece not in (OPEN, CLOSE):
                parts.append(piece)
                length += len(piece)
        text = "".join(parts)
        if start is not None or text != plain:
            raise UserError(
                f"The chat template {self.where} changes the text inside its {{% generation %}} blocks (or the "
                f"conversation contains the private-use characters U+E000/U+E001 used to find them), so the "
                "assistant's tokens cannot be located. Fix: keep {% generation %} blocks at the template's top level "
                "of output, not inside filters or captured variables, and remove those characters from the messages."
            )
        return text, spans


class _OverBudget(UserError):
    """A template stopped by its budget: refused by `check`, where a conversation the template's rules refuse is not."""


def template_tokens(config: Mapping[str, Any], legacy: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens a template sees as variables, as transformers' `special_tokens_map` has them: each
    `*_token` entry of tokenizer_config.json that names a token (bos_token, eos_token, ... and model-specific ones
    such as image_token, also under `extra_special_tokens`), with special_tokens_map.json's entries on top in an
    old folder, whose config has no `added_tokens_decoder`."""
    entries = {**config, **(legacy if "added_tokens_decoder" not in config else {})}
    if isinstance(entries.get("extra_special_tokens"), Mapping):
        entries.update(entries["extra_special_tokens"])
    tokens = {}
    for key, value in entries.items():
        if isinstance(value, Mapping):  # an AddedToken: {"content": "<s>", "lstrip": false, ...}
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            tokens[key] = value
    return tokens


# READING A MODEL FOLDER ---------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        problem = None if isinstance(data, dict) else f"it holds a JSON {type(data).__name__}, not an object"
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or JSON, a 5,000-digit number
        problem = f"{type(e).__name__}: {str(e)[:200]}"
    if problem:
        raise UserError(f"{path} cannot be read as a JSON object ({problem}). Expected the file as the model's Hugging "
                        "Face folder has it. Fix: restore it from the model, or delete it if the model has none.")
    return data


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"The chat template {path} is not UTF-8 text ({e.reason} at byte {e.start}). Expected the "
                        "Jinja template a Hugging Face model ships. Fix: restore it from the model's folder.") from None


def _config_template(config: Mapping[str, Any], path: Path) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of named templates of which "default" is used."""
    entry = config.get("chat_template")
    if entry is None or isinstance(entry, str):
        return entry
    entries = entry if isinstance(entry, list) else []
    named = {t.get("name"): t.get("template") for t in entries if isinstance(t, Mapping)}
    if isinstance(named.get("default"), str):
        return named["default"]
    raise UserError(
        f"{path} has a `chat_template` entry that is neither a template string nor a list of named templates with "
        f"one named 'default' (names found: {', '.join(map(str, named)) or 'none'}). Fix: put the model's default "
        f"template in {path.with_name(TEMPLATE_FILE)}."
    )


def _plain_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The messages as fresh dicts without None values: templates handle a missing key, and some would write
    "None" (transformers drops them too)."""
    if isinstance(messages, (str, Mapping)) or not all(isinstance(m, Mapping) for m in messages):
        raise UserError(f"A conversation must be a list of messages such as {{'role': 'user', 'content': 'Hi'}}, "
                        f"but got {str(messages)[:200]!r}. Fix: pass a list of role/content dicts.")
    return [{key: value for key, value in m.items() if value is not None} for m in messages]


def find_chat_template(tokenizer: Tokenizer) -> ChatTemplate | None:
    """The chat template among the companions of `tokenizer`'s tokenizer.json (the file its name, a spec, points
    at), or None: the byte tokenizer, a file not named tokenizer.json (no Hugging Face folder's, see
    `tokenizer_files`), or a folder without a template. A template that breaks its budget is refused here
    (`ChatTemplate.check`)."""
    if tokenizer.name == ByteTokenizer.name:
        return None
    path = tokenizer_file(tokenizer.name)
    template = ChatTemplate.load(path.parent, tokenizer) if path.name == RUN_FILE else None
    if template is not None:
        template.check()
    return template


class LazyTemplate:
    """The tokenizer's chat template, looked up at the first conversation a data reader meets (data in plain text
    never needs one, and its tokenizer need not have one). `what` names the conversational records in the error
    ("a conversation (`messages`)"), `fix` is the error's fix for this kind of data."""

    def __init__(self, tokenizer: Tokenizer, what: str, fix: str):
        self.tokenizer, self.what, self.fix = tokenizer, what, fix
        self._template, self._looked = None, False

    def __call__(self, where: str) -> ChatTemplate:
        if not self._looked:
            self._template, self._looked = find_chat_template(self.tokenizer), True
        if self._template is None:
            raise UserError(
                f"{where} is {self.what}, but the tokenizer data.tokenizer={self.tokenizer.name!r} has no chat "
                "template beside it (chat_template.jinja, or `chat_template` in tokenizer_config.json), so there is "
                f"no format to write it in. Fix: {self.fix}")
        return self._template
