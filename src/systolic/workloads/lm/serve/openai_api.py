"""The OpenAI API's side of `systolic serve`: request bodies checked into frozen dataclasses, prompts turned into
token ids within the model's context, and the JSON of responses, stream chunks and errors as OpenAI documents them
(https://platform.openai.com/docs/api-reference/completions, .../chat) and its `openai` client reads them.

Every mistake in a request is an `APIError`: status 400 (404 for an unknown model) and OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. A field is read once by type, a null counts as left out (clients
send nulls for unset fields), and an unknown field is an error, as on OpenAI's API, so a typo is not silently
ignored. Fields that ask for something the engine does not do (penalties, logit biases, tools) are accepted only at
their neutral value. The extensions of the API that vLLM added and that clients send (lm-evaluation-harness, guidellm,
vLLM's own benchmarks) are read as vLLM reads them: see VLLM'S EXTENSIONS below.
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
from systolic.workloads.lm.serve.logprobs import TokenLogprob
from systolic.workloads.lm.serve.step import MAX_LOGPROBS

if TYPE_CHECKING:
    from systolic.data.chat import ChatTemplate
    from systolic.data.tokenizer import Tokenizer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
MAX_STOP_STRINGS = 4  # as OpenAI: each is matched against the decoded text after every token
# "developer" is the system role's name for OpenAI's reasoning models; templates know "system".
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# A logprob of -inf (a token the sampler could not pick) has no JSON spelling; OpenAI writes this value instead.
LOGPROB_FLOOR = -9999.0
MAX_CHOICES = 16  # n and best_of: each choice is a request of its own in the engine's batch
MAX_PROMPTS = 64  # prompts in one /v1/completions request (lm-evaluation-harness batches them)


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
    top_logprobs: int = 0  # alternatives for each token (completions' logprobs=N, chat's top_logprobs)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # choices generated per prompt, the n with the highest summed log-probability returned
    echo: bool = False  # completions: the prompt (and its tokens' log-probabilities) before the completion
    vllm: VLLMFields = dataclasses.field(default_factory=lambda: VLLMFields())


@dataclasses.dataclass(frozen=True)
class VLLMFields:
    """vLLM's extensions of the request (https://docs.vllm.ai, "Extra parameters"), at their defaults."""

    ignore_eos: bool = False  # generate past the model's end-of-text ids (stop_token_ids still stop)
    min_tokens: int = 0  # no stop id is sampled before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # ids that end the completion, besides the model's end of text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    add_special_tokens: bool = True  # completions: the tokenizer's own additions to a text prompt (Llama's <s>)
    continuous_usage_stats: bool = False  # stream_options: the token counts so far in every chunk


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[str | tuple[int, ...], ...]  # each text, or token ids
    sampling: Sampling


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, str], ...]  # {"role": ..., "content": ...} (and "name"), as the chat template reads them
    sampling: Sampling


_SHARED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "stream",
           "stream_options", "n", "presence_penalty", "frequency_penalty", "logit_bias", "user"}
_VLLM = {"ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
         "repetition_penalty", "add_special_tokens"}
_COMPLETION_FIELDS = _SHARED | _VLLM | {"prompt", "best_of", "echo", "suffix"}
_CHAT_FIELDS = _SHARED | _VLLM | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                                  "tool_choice", "store"}


def parse_completion(body: object) -> CompletionRequest:
    """A /v1/completions body, checked. Raises APIError (400)."""
    fields = _Fields(body, _COMPLETION_FIELDS)
    fields.neutral("suffix", None, "it asks for text inserted before a suffix, which causal models do not do")
    # logprobs=N: each token's log-probability and its N most likely alternatives (OpenAI allows 5, vLLM 20).
    logprobs = fields.integer("logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    sampling = _sampling(fields, "max_tokens", logprobs is not None, logprobs or 0, minimum_tokens=0)
    echo = fields.boolean("echo", False)
    best_of = fields.integer("best_of", sampling.n, minimum=sampling.n, maximum=MAX_CHOICES)
    if best_of > sampling.n and sampling.stream:
        raise bad_request(f"best_of={best_of} with stream=true: the best {sampling.n} of {best_of} are known only "
                          "when all have finished, so they cannot be streamed. Fix: drop best_of, or stream=false.",
                          param="best_of")
    if sampling.max_tokens == 0 and not echo:
        raise bad_request("max_tokens=0 without echo asks for nothing: no completion and no prompt. Fix: "
                          "max_tokens >= 1, or echo=true (with logprobs) to score the prompt.", param="max_tokens")
    return CompletionRequest(model=fields.model(), prompts=_prompts(fields.take("prompt")),
                             sampling=dataclasses.replace(sampling, echo=echo, best_of=best_of))


def parse_chat(body: object) -> ChatRequest:
    """A /v1/chat/completions body, checked. Raises APIError (400)."""
    fields = _Fields(body, _CHAT_FIELDS)
    fields.neutral("add_special_tokens", False, "a chat's prompt is the template's text, which adds what it needs")
    fields.neutral("tool_choice", "none", "the server does not call tools")
    fields.neutral("response_format", {"type": "text"}, "the server writes free text; it does not constrain output "
                   "to JSON")
    fields.neutral("store", False, "the server keeps no completions")
    if fields.present("max_tokens") and fields.present("max_completion_tokens"):
        raise bad_request("Both max_tokens and max_completion_tokens are set; they mean the same thing. Fix: send "
                          "one of them.", param="max_completion_tokens")
    limit = "max_completion_tokens" if fields.present("max_completion_tokens") else "max_tokens"
    logprobs = fields.boolean("logprobs", False)
    top = fields.integer("top_logprobs", 0, minimum=0, maximum=MAX_LOGPROBS)
    if top and not logprobs:
        raise bad_request(f"top_logprobs={top} needs logprobs=true: the alternatives come with each token's own "
                          "log-probability. Fix: add \"logprobs\": true.", param="top_logprobs")
    return ChatRequest(model=fields.model(), messages=_messages(fields.take("messages")),
                       sampling=_sampling(fields, limit, logprobs, top))


def _sampling(fields: _Fields, limit: str, logprobs: bool, top_logprobs: int = 0, *,
              minimum_tokens: int = 1) -> Sampling:
    fields.neutral("presence_penalty", 0, "the sampler has no penalties")
    fields.neutral("frequency_penalty", 0, "the sampler has no penalties")
    fields.neutral("logit_bias", {}, "the sampler has no logit biases")
    fields.string("user", None)  # an end-user id for abuse monitoring on OpenAI's side; nothing to do with it here
    stream = fields.boolean("stream", False)
    options = _stream_options(fields.take("stream_options"), stream)
    top_p = fields.number("top_p", 1.0, minimum=0.0, maximum=1.0)
    top_k = fields.integer("top_k", 0, minimum=-1, maximum=INT32_MAX)  # the engine's int32 row (past V: every id)
    n = fields.integer("n", 1, minimum=1, maximum=MAX_CHOICES)
    return Sampling(
        max_tokens=fields.integer(limit, None, minimum=minimum_tokens),
        temperature=fields.number("temperature", 1.0, minimum=0.0),
        # top_p=0 keeps only the most likely token, as top_p -> 0 does; the sampler needs a positive value for that.
        top_p=top_p if top_p > 0 else 1e-9,
        top_k=max(top_k, 0),  # -1 is vLLM's "off", as 0 is ours
        seed=fields.integer("seed", None, minimum=0, maximum=MAX_SEED),
        stop=_stop(fields.take("stop")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        n=n,
        best_of=n,
        vllm=_vllm_fields(fields, bool(options.get("continuous_usage_stats"))),
    )


def sampling_params(sampling: Sampling, max_tokens: int, end_ids: tuple[int, ...], *, sample: int = 0,
                    best_of: bool = False) -> SamplingParams:
    """The engine's settings for choice number `sample` of a prompt (each choice draws from seed + sample).
    `end_ids`: the model's end-of-text ids (a chat passes its template's), which ignore_eos drops; with `best_of`,
    log-probabilities are kept for ranking the choices."""
    vllm = sampling.vllm
    seed = None if sampling.seed is None else (sampling.seed + sample) % (MAX_SEED + 1)
    # echo with logprobs scores the prompt; echo with max_tokens=0 runs only the prompt, so it is scored then too.
    scored = sampling.echo and (sampling.logprobs or max_tokens == 0)
    return SamplingParams(
        max_tokens=max_tokens, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        seed=seed, stop=sampling.stop, logprobs=sampling.logprobs or best_of, top_logprobs=sampling.top_logprobs,
        stop_token_ids=tuple(dict.fromkeys((*(() if vllm.ignore_eos else end_ids), *vllm.stop_token_ids))),
        prompt_logprobs=sampling.top_logprobs if scored else None, min_tokens=vllm.min_tokens,
        include_stop_str=vllm.include_stop_str_in_output, skip_special_tokens=vllm.skip_special_tokens)


def _stream_options(options: object, stream: bool) -> dict[str, bool]:
    known = {"include_usage", "continuous_usage_stats"}  # OpenAI's, and vLLM's token counts in every chunk
    if options is None:
        return {}
    if (not stream or not isinstance(options, dict) or set(options) - known
            or not all(isinstance(v, bool) for v in options.values())):
        raise bad_request(f"stream_options={_short(options)} is not valid: it is {{\"include_usage\": true|false, "
                          "\"continuous_usage_stats\": true|false}, and only with stream=true. Fix: drop it, or set "
                          "stream=true.", param="stream_options")
    return options


# VLLM'S EXTENSIONS --------------------------------------------------------------------------------------------


def _vllm_fields(fields: _Fields, continuous_usage_stats: bool) -> VLLMFields:
    """The sampling fields vLLM adds, which load generators and evaluation harnesses send."""
    fields.neutral("repetition_penalty", 1.0, "the sampler has no penalties")
    stop_ids = fields.take("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(type(i) is int and i >= 0 for i in stop_ids)):
        raise bad_request(f"stop_token_ids must be a list of token ids (integers >= 0); got {_short(stop_ids)}. Fix: "
                          "e.g. [2, 32000].", param="stop_token_ids")
    return VLLMFields(
        ignore_eos=fields.boolean("ignore_eos", False),
        min_tokens=fields.integer("min_tokens", 0, minimum=0),
        stop_token_ids=tuple(stop_ids or ()),
        include_stop_str_in_output=fields.boolean("include_stop_str_in_output", False),
        skip_special_tokens=fields.boolean("skip_special_tokens", True),
        add_special_tokens=fields.boolean("add_special_tokens", True),
        continuous_usage_stats=continuous_usage_stats,
    )


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


def _prompts(value: object) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's prompt forms: a string, token ids, or a list of up to MAX_PROMPTS of either."""
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        if len(value) > MAX_PROMPTS:
            raise bad_request(f"prompt holds {len(value)} prompts; one request takes at most {MAX_PROMPTS}. Fix: "
                              "split them over several requests.", param="prompt")
        return tuple(_prompt(p) for p in value)
    return (_prompt(value),)


def _prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(i) is int for i in value):
        return tuple(value)
    raise bad_request(
        f"prompt must be a string, a non-empty list of token ids, or a list of such prompts; got {_short(value)}. "
        "Fix: send e.g. \"prompt\": \"Once upon a time\".", param="prompt")


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


def completion_prompt_ids(prompt: str | tuple[int, ...], tokenizer: Tokenizer, *,
                          add_special_tokens: bool = True) -> np.ndarray:
    """The prompt's token ids, int32 (P,). Special tokens spelt in a text prompt are those tokens ("<|im_end|>" is
    one id), and `add_special_tokens` adds what the tokenizer adds at the start (Llama's <s>), as transformers and
    vLLM tokenize a prompt. An empty text starts a fresh document (the end-of-document id), as `systolic generate`
    does."""
    if isinstance(prompt, tuple):
        # Checked as Python ints: an id past int64 (2**63) would overflow NumPy before any range check.
        bad = next((i for i in prompt if not 0 <= i < tokenizer.vocab_size), None)
        if bad is not None:
            raise bad_request(f"prompt holds the token id {_short(bad)}, outside the tokenizer's ids 0 to "
                              f"{tokenizer.vocab_size - 1}. Fix: encode the prompt with this model's tokenizer, or "
                              "send text.", param="prompt")
        return np.asarray(prompt, np.int32)
    try:
        ids = tokenizer.encode_with_specials(prompt, add_special_tokens=add_special_tokens)[0].astype(np.int32)
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


@dataclasses.dataclass(frozen=True)
class LoggedToken:
    """A token of a reply's log-probabilities: its text, its log-probability (None for a prompt's first token) and
    its alternatives as (text, log-probability), most likely first (None when none were asked for)."""

    text: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] | None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finite_logprob(value: float | None) -> float | None:
    return None if value is None else value if math.isfinite(value) else LOGPROB_FLOOR


class CompletionShape:
    """The JSON of one /v1/completions answer: the whole response, or its stream chunks, for any number of choices
    (by index). Keeps each choice's text offsets of the log-probabilities across chunks."""

    prefix = "cmpl"

    def __init__(self, model: str):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}

    def opening(self, index: int) -> list[dict[str, Any]]:
        return []  # a completion's first chunk is its first text

    def chunk(self, index: int, text: str, tokens: list[LoggedToken] | None, finish_reason: str | None) -> dict:
        return self._wrap("text_completion", [self._choice(index, text, tokens, finish_reason)])

    def response(self, choices: list[tuple[str, list[LoggedToken] | None, str | None]], counts: dict[str, int]) -> dict:
        """choices: (text, tokens, finish_reason) by index."""
        return {**self._wrap("text_completion", [self._choice(i, *c) for i, c in enumerate(choices)]), "usage": counts}

    def usage_chunk(self, counts: dict[str, int]) -> dict:
        return {**self._wrap("text_completion", []), "usage": counts}

    def _choice(self, index: int, text: str, tokens: list[LoggedToken] | None, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": self._logprobs(index, tokens), "finish_reason": finish_reason}

    def _wrap(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, index: int, tokens: list[LoggedToken] | None) -> dict | None:
        if tokens is None:
            return None
        offsets = []
        for token in tokens:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(token.text)
        asked = any(t.top is not None for t in tokens)
        return {"tokens": [t.text for t in tokens], "token_logprobs": [finite_logprob(t.logprob) for t in tokens],
                # as OpenAI: {text: log-probability} of the alternatives at each token (null for the prompt's first)
                "top_logprobs": [None if t.top is None else _by_text(t.top) for t in tokens] if asked else None,
                "text_offset": offsets}


def _by_text(top: tuple[tuple[str, float], ...]) -> dict[str, float | None]:
    """{text: log-probability}, most likely first; ids that decode to the same text keep the likelier's."""
    out: dict[str, float | None] = {}
    for text, logprob in top:
        out.setdefault(text, finite_logprob(logprob))
    return out


class ChatShape(CompletionShape):
    """The JSON of one /v1/chat/completions answer: the assistant's messages, or their deltas."""

    prefix = "chatcmpl"

    def opening(self, index: int) -> list[dict[str, Any]]:
        # OpenAI's first chunk names the role; the content follows in later deltas.
        return [self._wrap("chat.completion.chunk", [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}])]

    def chunk(self, index: int, text: str, tokens: list[LoggedToken] | None, finish_reason: str | None) -> dict:
        return self._wrap("chat.completion.chunk", [{"index": index, "delta": {"content": text} if text else {},
                                                     "logprobs": self._logprobs(index, tokens),
                                                     "finish_reason": finish_reason}])

    def response(self, choices: list[tuple[str, list[LoggedToken] | None, str | None]], counts: dict[str, int]) -> dict:
        out = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": self._logprobs(i, tokens),
                "finish_reason": finish} for i, (text, tokens, finish) in enumerate(choices)]
        return {**self._wrap("chat.completion", out), "usage": counts}

    def usage_chunk(self, counts: dict[str, int]) -> dict:
        return {**self._wrap("chat.completion.chunk", []), "usage": counts}

    def _logprobs(self, index: int, tokens: list[LoggedToken] | None) -> dict | None:
        if tokens is None:
            return None

        def entry(text: str, logprob: float | None) -> dict:
            return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t.text, t.logprob), "top_logprobs": [entry(*alt) for alt in t.top or ()]}
                            for t in tokens], "refusal": None}


def token_logprobs(events: Sequence[TokenEvent], tokenizer: Tokenizer, top: int) -> list[LoggedToken]:
    """The generated tokens among `events`, with their `top` alternatives (None for 0)."""
    return [LoggedToken(tokenizer.decode([e.token_id]), e.logprob, _alternatives(e.top, tokenizer, top))
            for e in events if e.token_id is not None]


def prompt_logprobs(scored: Sequence[TokenLogprob], tokenizer: Tokenizer, top: int) -> list[LoggedToken]:
    """A prompt's tokens as `echo` returns them: the first has no log-probability and no alternatives."""
    return [LoggedToken(tokenizer.decode([t.token_id]), t.logprob,
                        None if t.logprob is None else _alternatives(t.top, tokenizer, top)) for t in scored]


def _alternatives(top: Sequence[tuple[int, float]], tokenizer: Tokenizer, count: int
                  ) -> tuple[tuple[str, float], ...] | None:
    return tuple((tokenizer.decode([i]), lp) for i, lp in top[:count]) if count else None
