"""The OpenAI API's side of `systolic serve`: request bodies checked into frozen dataclasses, prompts turned into
token ids within the model's context, and the JSON of responses, stream chunks and errors as OpenAI documents them
(https://platform.openai.com/docs/api-reference/completions, .../chat) and its `openai` client reads them.

Every mistake in a request is an `APIError`: status 400 (404 for an unknown model) and OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. A field is read once by type, a null counts as left out (clients
send nulls for unset fields), and an unknown field is an error, as on OpenAI's API, so a typo is not silently
ignored. Fields that ask for something the engine does not do (several choices, penalties, the top alternatives'
log-probabilities) are accepted only at their neutral value.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from systolic.config import MAX_SEED
from systolic.errors import UserError
from systolic.workloads.lm.serve.engine import INT32_MAX, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from systolic.data.chat import ChatTemplate
    from systolic.data.tokenizer import Tokenizer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
MAX_STOP_STRINGS = 4  # as OpenAI: each is matched against the decoded text after every token
# "developer" is the system role's name for OpenAI's reasoning models; templates know "system".
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# A logprob of -inf (a token the sampler could not pick) has no JSON spelling; OpenAI writes this value instead.
LOGPROB_FLOOR = -9999.0


class APIError(Exception):
    """A request the server refuses, with OpenAI's error fields; `headers` go on the response (Retry-After)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        # A request's own text echoed back (a model name, a field) may hold a lone surrogate from a JSON escape,
        # which has no UTF-8 form: the response could not be written, and the client would get a 500 instead.
        message, param = _writable(message), None if param is None else _writable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _writable(text: str) -> str:
    """`text` with every character UTF-8 cannot encode (lone surrogates) written as its escape, e.g. \\ud800."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# REQUESTS -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The generation fields that both endpoints share. max_tokens None: the endpoint's default."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # not OpenAI's; vLLM's extension, sent by clients as extra_body={"top_k": 40}
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids
    sampling: Sampling


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, str], ...]  # {"role": ..., "content": ...} (and "name"), as the chat template reads them
    sampling: Sampling


_SHARED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "stream",
           "stream_options", "n", "presence_penalty", "frequency_penalty", "logit_bias", "user"}
_COMPLETION_FIELDS = _SHARED | {"prompt", "best_of", "echo", "suffix"}
_CHAT_FIELDS = _SHARED | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                          "tool_choice", "store"}


def parse_completion(body: object) -> CompletionRequest:
    """A /v1/completions body, checked. Raises APIError (400)."""
    fields = _Fields(body, _COMPLETION_FIELDS)
    fields.neutral("best_of", 1, "it asks for the best of several completions; the server makes one")
    fields.neutral("echo", False, "it returns the prompt with the completion; send the prompt yourself")
    fields.neutral("suffix", None, "it asks for text inserted before a suffix, which causal models do not do")
    logprobs = fields.integer("logprobs", None, minimum=0)
    if logprobs not in (None, 0):
        raise bad_request(
            f"logprobs={logprobs} asks for the {logprobs} most likely tokens at each step, but the server returns the "
            "log-probability of the chosen token only. Fix: send logprobs=0.", param="logprobs")
    return CompletionRequest(model=fields.model(), prompt=_prompt(fields.take("prompt")),
                             sampling=_sampling(fields, "max_tokens", logprobs is not None))


def parse_chat(body: object) -> ChatRequest:
    """A /v1/chat/completions body, checked. Raises APIError (400)."""
    fields = _Fields(body, _CHAT_FIELDS)
    fields.neutral("top_logprobs", 0, "the server returns the log-probability of the chosen token only")
    fields.neutral("tools", [], "the server does not call tools")
    fields.neutral("tool_choice", "none", "the server does not call tools")
    fields.neutral("response_format", {"type": "text"}, "the server writes free text; it does not constrain output "
                   "to JSON")
    fields.neutral("store", False, "the server keeps no completions")
    if fields.present("max_tokens") and fields.present("max_completion_tokens"):
        raise bad_request("Both max_tokens and max_completion_tokens are set; they mean the same thing. Fix: send "
                          "one of them.", param="max_completion_tokens")
    limit = "max_completion_tokens" if fields.present("max_completion_tokens") else "max_tokens"
    logprobs = fields.boolean("logprobs", False)
    return ChatRequest(model=fields.model(), messages=_messages(fields.take("messages")),
                       sampling=_sampling(fields, limit, logprobs))


def _sampling(fields: _Fields, limit: str, logprobs: bool) -> Sampling:
    fields.neutral("n", 1, "it asks for several choices, and the server makes one per request (send several "
                   "requests, with different seeds, for more)")
    fields.neutral("presence_penalty", 0, "the sampler has no penalties")
    fields.neutral("frequency_penalty", 0, "the sampler has no penalties")
    fields.neutral("logit_bias", {}, "the sampler has no logit biases")
    fields.string("user", None)  # an end-user id for abuse monitoring on OpenAI's side; nothing to do with it here
    stream = fields.boolean("stream", False)
    options = fields.take("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise bad_request(f"stream_options={options!r} is not valid: it is {{\"include_usage\": true|false}}, and "
                          "only with stream=true. Fix: drop it, or set stream=true.", param="stream_options")
    top_p = fields.number("top_p", 1.0, minimum=0.0, maximum=1.0)
    top_k = fields.integer("top_k", 0, minimum=-1, maximum=INT32_MAX)  # the engine's int32 row (past V: every id)
    return Sampling(
        max_tokens=fields.integer(limit, None, minimum=1),
        temperature=fields.number("temperature", 1.0, minimum=0.0),
        # top_p=0 keeps only the most likely token, as top_p -> 0 does; the sampler needs a positive value for that.
        top_p=top_p if top_p > 0 else 1e-9,
        top_k=max(top_k, 0),  # -1 is vLLM's "off", as 0 is ours
        seed=fields.integer("seed", None, minimum=0, maximum=MAX_SEED),
        stop=_stop(fields.take("stop")),
        logprobs=logprobs,
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
    )


def sampling_params(sampling: Sampling, max_tokens: int,
                    stop_token_ids: tuple[int, ...] | None = None) -> SamplingParams:
    """The engine's settings; `stop_token_ids` None: the model's eos ids (a chat passes its template's)."""
    return SamplingParams(max_tokens=max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                          top_p=sampling.top_p, seed=sampling.seed, stop=sampling.stop, logprobs=sampling.logprobs,
                          stop_token_ids=stop_token_ids)


class _Fields:
    """A request body's fields, each read once by type; null is the same as left out."""

    def __init__(self, body: object, known: set[str]):
        if not isinstance(body, dict):
            raise bad_request(f"The request body must be a JSON object, but it is a JSON {_json_type(body)}. Fix: send "
                              "an object such as {\"model\": ..., \"prompt\": ...}.")
        unknown = sorted(set(body) - known)
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}. The fields this endpoint reads "
                              f"are: {', '.join(sorted(known))}. Fix: remove it, or correct its spelling.",
                              param=unknown[0])
        self.body = body

    def present(self, name: str) -> bool:
        return self.body.get(name) is not None

    def take(self, name: str) -> Any:
        return self.body.get(name)

    def model(self) -> str:
        value = self.body.get("model")
        if not isinstance(value, str) or not value:
            raise bad_request("The request has no `model` (a string). Fix: send the name that GET /v1/models lists.",
                              param="model")
        return value

    def string(self, name: str, default: str | None) -> str | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise _wrong_type(name, value, "a string")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise _wrong_type(name, value, "true or false")
        return value

    def integer(self, name: str, default: int | None, *, minimum: int | None = None,
                maximum: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if type(value) is not int:  # bool is an int in Python, not in JSON
            raise _wrong_type(name, value, "an integer")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise _out_of_range(name, value, minimum, maximum)
        return value

    def number(self, name: str, default: float, *, minimum: float, maximum: float | None = None) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong_type(name, value, "a number")
        try:
            value = float(value)
        except OverflowError:  # an integer past float's range
            value = math.inf
        if not math.isfinite(value):  # Python's JSON reads NaN and Infinity, and 1e999 as inf
            raise bad_request(f"{name}={value} is not a finite number. Fix: send a number such as {minimum:g}.",
                              param=name)
        if value < minimum or (maximum is not None and value > maximum):
            raise _out_of_range(name, value, minimum, maximum)
        return value

    def neutral(self, name: str, neutral: object, why: str) -> None:
        """Accepts `name` only left out or at `neutral` (0 and 1.0 count as 0 and 1)."""
        value = self.body.get(name)
        if value is not None and not (value == neutral and isinstance(value, bool) == isinstance(neutral, bool)):
            raise bad_request(f"{name}={value!r} is not supported by this server: {why}. Fix: leave {name} out (or "
                              f"send {neutral!r}).", param=name)


def _wrong_type(name: str, value: object, expected: str) -> APIError:
    return bad_request(f"{name} must be {expected}, but it is a JSON {_json_type(value)} ({_short(value)}). Fix: send "
                       f"{expected}.", param=name)


def _out_of_range(name: str, value: float, minimum: float | None, maximum: float | None) -> APIError:
    span = (f"from {minimum:g} to {maximum:g}" if minimum is not None and maximum is not None else
            f"at least {minimum:g}" if minimum is not None else f"at most {maximum:g}")
    return bad_request(f"{name}={value:g} is out of range: it must be {span}. Fix: send a value in that range.",
                       param=name)


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _prompt(value: object) -> str | tuple[int, ...]:
    """OpenAI's prompt forms: a string, token ids, or a one-element list of either (one prompt per request)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(i) is int for i in value):
        return tuple(value)
    many = isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value)
    raise bad_request(
        f"prompt must be one prompt: a string, or a non-empty list of token ids; got {_short(value)}. "
        + ("The server takes one prompt per request. Fix: send each prompt in its own request." if many else
           "Fix: send e.g. \"prompt\": \"Once upon a time\"."), param="prompt")


def _stop(value: object) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if value is None:
        return ()
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad_request(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them; got "
                          f"{_short(value)}. Fix: e.g. \"stop\": [\"\\n\\n\"].", param="stop")
    return tuple(stops)


def _messages(value: object) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise bad_request(f"messages must be a non-empty list of messages such as {{\"role\": \"user\", \"content\": "
                          f"\"Hi\"}}; got {_short(value)}. Fix: send the conversation as that list.", param="messages")
    return tuple(_message(i, m) for i, m in enumerate(value))


def _message(i: int, message: object) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object with a role and a content; got {_short(message)}.", param=where)
    # Keys a client sends back unset when it echoes an assistant message it received (refusal, tool_calls, ...).
    fields = {k: v for k, v in message.items() if v is not None and v != []}
    extra = sorted(set(fields) - {"role", "content", "name"})
    if extra:
        raise bad_request(f"{where} has {extra[0]!r}, which this server does not read (it has no tools, audio or "
                          "images): a message is a role, a content and optionally a name. Fix: remove it.",
                          param=f"{where}.{extra[0]}")
    role = fields.get("role")
    role = CHAT_ROLES.get(role) if isinstance(role, str) else None  # a list or an object cannot be looked up
    if role is None:
        raise bad_request(f"{where} has role {_short(fields.get('role'))}; expected one of "
                          f"{', '.join(CHAT_ROLES)}. Fix: use one of those.", param=f"{where}.role")
    out = {"role": role, "content": _content(where, fields.get("content"))}
    if "name" in fields:
        if not isinstance(fields["name"], str):
            raise _wrong_type(f"{where}.name", fields["name"], "a string")
        out["name"] = fields["name"]
    return out


def _content(where: str, content: object) -> str:
    """A message's text: a string, or a list of text parts (joined by newlines, as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise bad_request(f"{where}.content must be a string or a list of {{\"type\": \"text\", \"text\": ...}} parts; got "
                      f"{_short(content)}. This server reads text only. Fix: send the text as a string.",
                      param=f"{where}.content")


# PROMPTS AND THE CONTEXT --------------------------------------------------------------------------------------


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(404, f"The model `{requested}` does not exist: this server serves `{served}` only. Fix: send "
                       f"\"model\": \"{served}\" (GET /v1/models lists it).", param="model", code="model_not_found")


def completion_prompt_ids(prompt: str | tuple[int, ...], tokenizer: Tokenizer) -> np.ndarray:
    """The prompt's token ids, int32 (P,). An empty text starts a fresh document (the end-of-document id), as
    `systolic generate` does."""
    if isinstance(prompt, tuple):
        # Checked as Python ints: an id past int64 (2**63) would overflow NumPy before any range check.
        bad = next((i for i in prompt if not 0 <= i < tokenizer.vocab_size), None)
        if bad is not None:
            raise bad_request(f"prompt holds the token id {_short(bad)}, outside the tokenizer's ids 0 to "
                              f"{tokenizer.vocab_size - 1}. Fix: encode the prompt with this model's tokenizer, or "
                              "send text.", param="prompt")
        return np.asarray(prompt, np.int32)
    try:
        ids = tokenizer.encode(prompt).astype(np.int32)
    except UserError as e:  # text that is not Unicode (a lone surrogate from a JSON escape)
        raise bad_request(str(e), param="prompt") from None
    return ids if len(ids) else np.array([tokenizer.eot_id], np.int32)


def chat_prompt_ids(messages: Sequence[Mapping[str, str]], template: ChatTemplate | None, model: str) -> np.ndarray:
    """The conversation rendered by the model's chat template, followed by the header of the assistant's reply."""
    if template is None:
        raise bad_request(f"The model `{model}` has no chat template, so a conversation cannot be written in the "
                          "format it was trained on. Fix: use /v1/completions with plain text, or serve a run that has "
                          "one (a model imported with its chat_template.jinja).", param="messages")
    try:
        return template.encode(list(messages), add_generation_prompt=True).astype(np.int32)
    except UserError as e:  # the template raised: roles that do not alternate, a system message it does not allow
        raise bad_request(str(e), param="messages") from None


def token_budget(prompt_tokens: int, requested: int | None, max_context: int, *, default: int | None,
                 prompt_param: str, limit_param: str) -> int:
    """How many tokens to generate after a prompt of `prompt_tokens`: `requested`, else `default` (None: the rest of
    the context) cut to what the context holds. Raises APIError (400) when the prompt or the request does not fit."""
    room = max_context - prompt_tokens
    if room < 1:
        raise bad_request(f"This model's maximum context length is {max_context} tokens, but the prompt has "
                          f"{prompt_tokens} tokens, which leaves no room for a reply. Fix: shorten the prompt to at "
                          f"most {max_context - 1} tokens.", param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(f"This model's maximum context length is {max_context} tokens, but "
                          f"{prompt_tokens + requested} were requested ({prompt_tokens} in the prompt, {requested} for "
                          f"the completion). Fix: lower {limit_param} to at most {room}, or shorten the prompt.",
                          param=limit_param, code="context_length_exceeded")
    return requested


# RESPONSES ----------------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finite_logprob(value: float | None) -> float | None:
    return None if value is None else value if math.isfinite(value) else LOGPROB_FLOOR


class CompletionShape:
    """The JSON of one /v1/completions answer: the whole response, or its stream chunks. Keeps the text offsets of
    the log-probabilities across chunks."""

    prefix = "cmpl"

    def __init__(self, model: str):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self._offset = 0

    def opening(self) -> list[dict[str, Any]]:
        return []  # a completion's first chunk is its first text

    def chunk(self, text: str, tokens: list[tuple[str, float | None]] | None, finish_reason: str | None) -> dict:
        return self._wrap("text_completion", {"index": 0, "text": text, "logprobs": self._logprobs(tokens),
                                              "finish_reason": finish_reason})

    def response(self, text: str, tokens: list[tuple[str, float | None]] | None, finish_reason: str | None,
                 counts: dict[str, int]) -> dict:
        return {**self.chunk(text, tokens, finish_reason), "usage": counts}

    def usage_chunk(self, counts: dict[str, int]) -> dict:
        return {**self._wrap("text_completion", None), "usage": counts}

    def _wrap(self, kind: str, choice: dict | None) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice]}

    def _logprobs(self, tokens: list[tuple[str, float | None]] | None) -> dict | None:
        if tokens is None:
            return None
        offsets = []
        for text, _ in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": [t for t, _ in tokens], "token_logprobs": [finite_logprob(lp) for _, lp in tokens],
                "top_logprobs": None, "text_offset": offsets}


class ChatShape(CompletionShape):
    """The JSON of one /v1/chat/completions answer: the assistant's message, or its deltas."""

    prefix = "chatcmpl"

    def opening(self) -> list[dict[str, Any]]:
        # OpenAI's first chunk names the role; the content follows in later deltas.
        return [self._wrap("chat.completion.chunk", {"index": 0, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None})]

    def chunk(self, text: str, tokens: list[tuple[str, float | None]] | None, finish_reason: str | None) -> dict:
        return self._wrap("chat.completion.chunk", {"index": 0, "delta": {"content": text} if text else {},
                                                    "logprobs": self._logprobs(tokens), "finish_reason": finish_reason})

    def response(self, text: str, tokens: list[tuple[str, float | None]] | None, finish_reason: str | None,
                 counts: dict[str, int]) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": self._logprobs(tokens),
                  "finish_reason": finish_reason}
        return {**self._wrap("chat.completion", choice), "usage": counts}

    def usage_chunk(self, counts: dict[str, int]) -> dict:
        return {**self._wrap("chat.completion.chunk", None), "usage": counts}

    def _logprobs(self, tokens: list[tuple[str, float | None]] | None) -> dict | None:
        if tokens is None:
            return None
        return {"content": [{"token": t, "logprob": finite_logprob(lp), "bytes": list(t.encode("utf-8")),
                             "top_logprobs": []} for t, lp in tokens], "refusal": None}


def token_logprobs(events: Sequence[TokenEvent], tokenizer: Tokenizer) -> list[tuple[str, float | None]]:
    """(the token's own text, its log-probability) for each generated token among `events`."""
    return [(tokenizer.decode([e.token_id]), e.logprob) for e in events if e.token_id is not None]
