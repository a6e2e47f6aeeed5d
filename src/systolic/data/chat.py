"""Chat templates: a conversation -> the prompt text and token ids a chat model was trained on, as transformers'
`apply_chat_template` makes them, and the assistant mask that supervised fine-tuning trains on.

A Hugging Face model ships its template as chat_template.jinja (transformers 5) or as the `chat_template` entry of
tokenizer_config.json (earlier versions), beside tokenizer.json; tokenizer_config.json (or an old folder's
special_tokens_map.json) names the special tokens the template reads (`bos_token`, `eos_token`, ...). A run keeps
these files beside its own tokenizer.json (`systolic.data.tokenizer.COMPANION_FILES`).

Rendering follows transformers: Jinja2's immutable sandbox (templates from the Hub are untrusted code),
trim_blocks and lstrip_blocks, the loop-control extension, `raise_exception`, `strftime_now`, a `tojson` that does
not escape HTML, and the variables messages, tools=None, documents=None, add_generation_prompt and the special
tokens. The text is tokenized with special tokens matched and none added (add_special_tokens=False), so the ids
equal `apply_chat_template(..., tokenize=True)`; tests/data/test_chat.py checks both against transformers.

The assistant mask marks what the model should learn to write: each assistant message from just after its
header (the generation prompt, e.g. `<|im_start|>assistant\\n`) through the end-of-turn token the template writes
after it (`<|im_end|>`, `<|eot_id|>`), without the whitespace that follows (layout that no one generates, such as
ChatML's newline after `<|im_end|>`). A token counts when it overlaps such a span (transformers' rule for its
assistant_masks). The spans come from rendering incrementally: the conversation before each assistant message
with add_generation_prompt=True, and through that message; a template whose renderings are not prefixes of one
another (one that rewrites earlier turns) is an error. A template with `{% generation %}` blocks marks its own
spans instead, as for transformers' `return_assistant_tokens_mask` and TRL's assistant-only loss.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from systolic.data.generation_config import eos_ids
from systolic.data.tokenizer import RUN_FILE, ByteTokenizer, Tokenizer, tokenizer_file
from systolic.errors import UserError

if TYPE_CHECKING:  # the Rust tokenizer library is imported by whoever makes the tokenizer
    from systolic.data.bpe import BPETokenizer

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"

Message = Mapping[str, Any]  # {"role": "user", "content": "..."}; other keys (tool_calls, ...) reach the template too

# Private-use characters that bracket `{% generation %}` output while its spans are found, then are removed.
_OPEN, _CLOSE = "\ue000", "\ue001"
_marking = contextvars.ContextVar("marking_generation", default=False)
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
            self._template = _compile(source)
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
            source, where = (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), folder / TEMPLATE_FILE
        else:
            source, where = _config_template(config, folder / CONFIG_FILE), folder / CONFIG_FILE
        if source is None:
            return None
        return cls(source, template_tokens(config, _read_json(folder / SPECIAL_TOKENS_FILE)), tokenizer, str(where))

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
        """The text of `messages`, as `apply_chat_template(messages, tokenize=False)` writes it; with
        add_generation_prompt, followed by the header that starts the assistant's reply."""
        return self._render(messages, add_generation_prompt, mark=False)

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
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            header = self.render(messages[:i], add_generation_prompt=True)
            turn = self.render(messages[: i + 1])
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

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool, *, mark: bool) -> str:
        messages = _plain_messages(messages)
        token = _marking.set(mark)
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        # raise_exception, an undefined variable, a sandbox violation; or data of the wrong type ("text" + a list)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise UserError(
                f"The chat template {self.where} failed on this conversation: {e}. Templates raise when a "
                "conversation breaks their rules (roles that do not alternate user/assistant, a system message "
                "where none is allowed) or reads something the conversation lacks. Fix: change the conversation to "
                "follow the rule named above."
            ) from None
        finally:
            _marking.reset(token)

    def _generation_spans(self, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
        marked = self._render(messages, False, mark=True)
        parts, spans, length, start = [], [], 0, None
        for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
            if piece == _OPEN and start is None:
                start = length
            elif piece == _CLOSE and start is not None:
                spans.append((start, length))
                start = None
            elif piece not in (_OPEN, _CLOSE):
                parts.append(piece)
                length += len(piece)
        text = "".join(parts)
        if start is not None or text != self.render(messages):
            raise UserError(
                f"The chat template {self.where} changes the text inside its {{% generation %}} blocks (or the "
                f"conversation contains the private-use characters U+E000/U+E001 used to find them), so the "
                "assistant's tokens cannot be located. Fix: keep {% generation %} blocks at the template's top level "
                "of output, not inside filters or captured variables, and remove those characters from the messages."
            )
        return text, spans


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


# THE JINJA ENVIRONMENT ----------------------------------------------------------------------------------------


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' tag for the text an assistant produces): rendered as
    its body, bracketed by _OPEN/_CLOSE while `_generation_spans` is looking for it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_output"), [], [], body).set_lineno(lineno)

    def _output(self, caller) -> str:
        text = caller()
        return f"{_OPEN}{text}{_CLOSE}" if _marking.get() else text


class _Namespace(Namespace):
    """`namespace(...)` that refuses underscore-prefixed names, a way towards Python internals that the sandbox does
    not check on namespaces."""

    def __init__(*args, **kwargs):  # Namespace's signature: `self` may also be a keyword
        self, attrs = args[0], dict(*args[1:], **kwargs)
        _check_public(attrs)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_public([name])
        Namespace.__setitem__(self, name, value)


class _DictMaker:
    """`dict` inside templates: makes dicts without handing the template the `dict` type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys, value=None) -> dict:
        return dict.fromkeys(keys, value)


def _check_public(names) -> None:
    for name in names:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template may not store the underscore-prefixed name {name!r}")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect the plain JSON that transformers writes.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_DictMaker(), namespace=_Namespace)
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


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
    `tokenizer_files`), or a folder without a template."""
    if tokenizer.name == ByteTokenizer.name:
        return None
    path = tokenizer_file(tokenizer.name)
    return ChatTemplate.load(path.parent, tokenizer) if path.name == RUN_FILE else None


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
