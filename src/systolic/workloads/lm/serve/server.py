"""`systolic serve RUN_DIR`: the OpenAI API over HTTP in front of the inference engine, as a Starlette app on uvicorn.

Routes: POST /v1/completions and /v1/chat/completions (`stream: true` as server-sent events ending in
`data: [DONE]`), GET /v1/models, /health and /metrics (Prometheus). Handlers never touch the engine: they parse
and check the request (openai_api.py), tokenize it, submit it to the driver thread (driver.py) and await its
events. Every refusal is OpenAI's JSON error body with its status; a bug is a 500 with the same body (the
traceback goes to the server's log, never to the client).

A client that disconnects cancels its request, which frees its KV-cache pages at once. SIGTERM or Ctrl-C stops
accepting connections, lets the requests in flight finish for up to `grace_s` seconds, cancels the rest and
returns (exit code 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hmac
import ipaddress
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from systolic.errors import UserError
from systolic.workloads.lm.serve import openai_api as api
from systolic.workloads.lm.serve.driver import EngineDriver, QueueFull, RequestFailed, RequestStream, Stopped
from systolic.workloads.lm.serve.engine import SamplingParams, TokenEvent
from systolic.workloads.lm.serve.metrics import CONTENT_TYPE, RequestTimer, ServeMetrics

if TYPE_CHECKING:
    from systolic.data.chat import ChatTemplate
    from systolic.data.tokenizer import Tokenizer

DEFAULT_HOST = "127.0.0.1"
MAX_BODY_BYTES = 8 << 20  # far above any prompt that fits a context; a bound on what one request can make us hold
RETRY_AFTER_S = 1  # a full queue drains as requests finish: seconds on a CPU, less on an accelerator
SHUTDOWN_MARGIN_S = 5.0  # after the grace period: for the last error events to reach their clients
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away: counted, never seen by anyone
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the handlers need to know of the engine's model (the engine itself belongs to the driver thread)."""

    name: str
    max_context: int  # prompt + generated tokens
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    end_ids: tuple[int, ...]  # where a completion ends (data.generation_config.eos_ids), unless ignore_eos
    tokenizer_folder: str | None = None  # what Hugging Face tooling loads as the tokenizer (data/hf_tokenizer.py)


def make_app(info: ModelInfo, driver: EngineDriver, metrics: ServeMetrics, *, api_key: str | None) -> Starlette:
    """The ASGI app. With `api_key`, /v1/* and /metrics need `Authorization: Bearer <api_key>`; /health never does
    (load balancers and orchestrators probe it)."""
    handlers = _Handlers(info, driver, metrics, api_key)
    routes = [
        Route("/v1/completions", handlers.completions, methods=["POST"]),
        Route("/v1/chat/completions", handlers.chat, methods=["POST"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/v1/models/{model:path}", handlers.model, methods=["GET"]),
        Route("/health", handlers.health, methods=["GET"]),
        Route("/metrics", handlers.metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, middleware=[Middleware(_CountResponses, metrics=metrics)],
                     exception_handlers={api.APIError: _api_error, HTTPException: _http_error, Exception: _bug})


class _Handlers:
    def __init__(self, info: ModelInfo, driver: EngineDriver, metrics: ServeMetrics, api_key: str | None):
        self.info, self.driver, self._metrics, self._api_key = info, driver, metrics, api_key
        self._started = int(time.time())  # the model card's "created"

    async def health(self, request: Request) -> Response:
        if not self.driver.alive:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        self._authorize(request)
        return Response(self._metrics.exposition(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        api.check_model(request.path_params["model"], self.info.name)
        return JSONResponse(self._card())

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        req = api.parse_completion(await _json_body(request))
        api.check_model(req.model, self.info.name)
        prompts = []
        for prompt in req.prompts:
            ids = api.completion_prompt_ids(prompt, self.info.tokenizer,
                                            add_special_tokens=req.sampling.vllm.add_special_tokens)
            budget = api.token_budget(len(ids), req.sampling.max_tokens, self.info.max_context,
                                      default=api.COMPLETION_DEFAULT_MAX_TOKENS, prompt_param="prompt",
                                      limit_param="max_tokens")
            echo = "" if not req.sampling.echo else prompt if isinstance(prompt, str) else \
                self.info.tokenizer.decode(ids, skip_special_tokens=req.sampling.vllm.skip_special_tokens)
            prompts.append(_Prompt(ids, budget, echo))
        return await self._answer(request, prompts, self.info.end_ids, req.sampling,
                                  api.CompletionShape(self.info.name))

    async def chat(self, request: Request) -> Response:
        self._authorize(request)
        req = api.parse_chat(await _json_body(request))
        api.check_model(req.model, self.info.name)
        # In a worker thread: rendering waits on the template's sandbox (up to its time budget), not the event loop.
        ids = await run_in_threadpool(api.chat_prompt_ids, req.messages, self.info.chat_template, self.info.name)
        budget = api.token_budget(len(ids), req.sampling.max_tokens, self.info.max_context, default=None,
                                  prompt_param="messages", limit_param="max_tokens")
        # The reply ends at the template's end of turn (<|im_end|>, <|eot_id|>) as well as at the end of text.
        return await self._answer(request, [_Prompt(ids, budget, "")], self.info.chat_template.stop_ids, req.sampling,
                                  api.ChatShape(self.info.name))

    def _card(self) -> dict[str, Any]:
        # "root": as vLLM's card, what Hugging Face tooling loads (clients' tokenizer=... argument)
        return {"id": self.info.name, "object": "model", "created": self._started, "owned_by": "systolic",
                "root": self.info.tokenizer_folder or self.info.name, "max_model_len": self.info.max_context}

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise api.APIError(401, "Incorrect or missing API key. This server needs the header `Authorization: "
                               "Bearer <key>` with the key it was started with (--api-key). Fix: pass it, e.g. "
                               "OpenAI(api_key=...).", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    # ONE REQUEST ----------------------------------------------------------------------------------------------

    async def _answer(self, request: Request, prompts: list[_Prompt], end_ids: tuple[int, ...],
                      sampling: api.Sampling, shape: api.CompletionShape) -> Response:
        answer = _Answer(self, self._submit_all(prompts, end_ids, sampling, shape.id), shape, sampling,
                         sum(len(p.ids) for p in prompts))
        streaming = False
        try:
            if sampling.stream:
                # Each choice's first event before the headers: a request the engine refuses still gets its 400.
                firsts = [answer.checked(c, await _unless_disconnected(request, c.stream.next()))
                          for c in answer.choices]
                streaming = True
                return _EventStream(answer.chunks(firsts), on_close=answer.close, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            collected = await _unless_disconnected(request, asyncio.gather(*(c.stream.collect()
                                                                              for c in answer.choices)))
            return JSONResponse(answer.whole([[answer.checked(c, e) for e in events]
                                              for c, events in zip(answer.choices, collected, strict=True)]))
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except RequestFailed as e:
            answer.failed()
            raise _failure(e) from None
        finally:
            if not streaming:
                answer.close()

    def _submit_all(self, prompts: list[_Prompt], end_ids: tuple[int, ...], sampling: api.Sampling,
                    request_id: str) -> list[_Choice]:
        """best_of engine requests for each prompt (choice j draws from seed + j); none when one is refused."""
        choices: list[_Choice] = []
        try:
            for i, prompt in enumerate(prompts):
                for j in range(sampling.best_of):
                    params = api.sampling_params(sampling, prompt.budget, end_ids, sample=j,
                                                 best_of=sampling.best_of > sampling.n)
                    stream = self._submit(f"{request_id}-{i}-{j}", prompt.ids, params)
                    choices.append(_Choice(len(choices), i, prompt, stream, self._metrics.start_request(len(prompt.ids))))
        except api.APIError:
            for choice in choices:
                self.driver.cancel(choice.stream.request_id)
                choice.timer.finish("cancelled")
            raise
        return choices

    def _submit(self, request_id: str, ids: np.ndarray, params: SamplingParams) -> RequestStream:
        try:
            return self.driver.submit(request_id, ids, params)
        except QueueFull:
            raise api.APIError(
                429, f"The server is at capacity: {self.driver.capacity} requests in flight (the batch and the queue "
                "behind it). Fix: retry after the Retry-After seconds, or start the server with a larger --max-queue.",
                type="rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Stopped:
            raise api.APIError(503, "The server is shutting down. Fix: send the request again once it is back.",
                               type="server_error", code="shutting_down") from None


@dataclasses.dataclass(frozen=True, eq=False)
class _Prompt:
    ids: np.ndarray  # int32 (P,)
    budget: int  # tokens to generate
    echo: str  # the prompt's text, written before the completion (echo), else ""


@dataclasses.dataclass(frozen=True, eq=False)
class _Choice:
    """One engine request of a reply: choice `index` (before best_of picks), of prompt number `prompt_index`."""

    index: int
    prompt_index: int
    prompt: _Prompt
    stream: RequestStream
    timer: RequestTimer


class _Answer:
    """One HTTP request's reply: its choices' events turned into the endpoint's JSON, and their accounting."""

    def __init__(self, handlers: _Handlers, choices: list[_Choice], shape: api.CompletionShape,
                 sampling: api.Sampling, prompt_tokens: int):
        self.handlers, self.choices, self.shape = handlers, choices, shape
        self.sampling, self.prompt_tokens = sampling, prompt_tokens

    def checked(self, choice: _Choice, event: TokenEvent) -> TokenEvent:
        if event.finish_reason == "cancelled":  # not one the client asked for: the engine dropped it
            raise RequestFailed(503, "The request was cancelled on the server before it finished. Fix: send it again.")
        choice.timer.tokens_arrived(int(event.token_id is not None))
        if event.finish_reason is not None:
            choice.timer.finish(event.finish_reason)
        return event

    def whole(self, events: list[list[TokenEvent]]) -> dict[str, Any]:
        """The response of every choice's events (in self.choices' order); with best_of, each prompt's n choices of
        the highest summed log-probability."""
        replies = [(c, self._text(c, e, first=True), self._logprobs(c, e, first=True), e[-1].finish_reason,
                    sum(x.logprob or 0.0 for x in e if x.token_id is not None)) for c, e in zip(self.choices, events)]
        if self.sampling.best_of > self.sampling.n:
            prompts = sorted({c.prompt_index for c in self.choices})
            replies = [r for i in prompts for r in sorted((r for r in replies if r[0].prompt_index == i),
                                                          key=lambda r: -r[4])[:self.sampling.n]]
        return self.shape.response([r[1:4] for r in replies], self._usage())

    async def chunks(self, firsts: list[TokenEvent]) -> AsyncIterator[str]:
        """The stream's server-sent events: each choice's opening chunk, a chunk per batch of its tokens that arrived
        together, the usage chunk when asked for, and [DONE]; a failure midway is an error event, as OpenAI sends
        one."""
        for choice in self.choices:
            for chunk in self.shape.opening(choice.index):
                yield _sse(chunk)
        waiting: dict[asyncio.Future, _Choice] = {}
        try:
            for choice, first in zip(self.choices, firsts, strict=True):
                if (chunk := self._chunk(choice, [first], first=True)) is not None:
                    yield chunk
                if not choice.stream.finished:
                    waiting[asyncio.ensure_future(choice.stream.next())] = choice
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    choice = waiting.pop(task)
                    if (chunk := self._chunk(choice, [self.checked(choice, task.result())], first=False)) is not None:
                        yield chunk
                    if not choice.stream.finished:
                        waiting[asyncio.ensure_future(choice.stream.next())] = choice
        except RequestFailed as e:
            self.failed()
            yield _sse(_failure(e).body())
        else:
            if self.sampling.include_usage:
                yield _sse(self.shape.usage_chunk(self._usage()))
        finally:
            for task in waiting:
                task.cancel()
        yield "data: [DONE]\n\n"

    def failed(self) -> None:
        for choice in self.choices:
            choice.timer.finish("error")

    def close(self) -> None:
        """After the reply, whatever ended it: a choice still running (its client left) is cancelled."""
        for choice in self.choices:
            if not choice.stream.finished:
                self.handlers.driver.cancel(choice.stream.request_id)
                choice.timer.finish("cancelled")

    def _chunk(self, choice: _Choice, events: list[TokenEvent], *, first: bool) -> str | None:
        """The chunk of `events` and those already delivered after them, or None when it would say nothing."""
        events += [self.checked(choice, e) for e in choice.stream.ready()]
        text, finish = self._text(choice, events, first=first), events[-1].finish_reason
        if not (text or finish or self.sampling.logprobs):
            return None
        chunk = self.shape.chunk(choice.index, text, self._logprobs(choice, events, first=first), finish)
        if self.sampling.vllm.continuous_usage_stats:
            chunk["usage"] = self._usage()
        return _sse(chunk)

    def _text(self, choice: _Choice, events: list[TokenEvent], *, first: bool) -> str:
        return (choice.prompt.echo if first else "") + "".join(e.text for e in events)

    def _logprobs(self, choice: _Choice, events: list[TokenEvent], *, first: bool) -> list[api.LoggedToken] | None:
        if not self.sampling.logprobs:
            return None
        tokenizer, top = self.handlers.info.tokenizer, self.sampling.top_logprobs
        scored = events[0].prompt if first and self.sampling.echo else None
        head = [] if scored is None else api.prompt_logprobs(scored, tokenizer, top)
        return head + api.token_logprobs(events, tokenizer, top)

    def _usage(self) -> dict[str, int]:
        return api.usage(self.prompt_tokens, sum(c.timer.tokens for c in self.choices))


class _EventStream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends, even when the client left before the first
    chunk (a body iterator that never started runs no finally block of its own)."""

    def __init__(self, content: AsyncIterator[str], *, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """`work`'s result; raises _ClientGone when the client disconnects first (and cancels `work`). Starlette does
    not notice a disconnect while a handler waits, only while it streams."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    finished = False
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finished = task.done()
    finally:  # also when this handler is cancelled (uvicorn's shutdown past its grace period)
        watch.cancel()
        if not finished:
            task.cancel()
    if not finished:
        raise _ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


def _failure(e: RequestFailed) -> api.APIError:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return api.APIError(e.status, e.message, type=kind)


async def _json_body(request: Request) -> object:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise api.APIError(413, f"The request body is over {MAX_BODY_BYTES >> 20} MiB. Fix: send a shorter prompt "
                               "(it must fit the model's context anyway).", code="request_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        raise api.bad_request(f"The request body is not valid JSON ({type(e).__name__}: {str(e)[:200]}). Fix: send a "
                              "JSON object with Content-Type: application/json.") from None


# ERRORS AND COUNTS --------------------------------------------------------------------------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, api.APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    what = {404: f"There is no route {request.url.path}", 405: f"{request.url.path} does not take {request.method}"}
    message = (f"{what.get(exc.status_code, exc.detail)}. This server answers POST /v1/completions, POST "
               "/v1/chat/completions, GET /v1/models, GET /health and GET /metrics.")
    error = api.APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def _bug(request: Request, exc: Exception) -> Response:
    # Starlette logs the traceback after this response is sent (uvicorn's "Exception in ASGI application").
    error = api.APIError(500, f"Internal server error ({type(exc).__name__}): a bug in systolic, not in the request. "
                         "The server's log has the traceback; it goes on serving.", type="server_error")
    return JSONResponse(error.body(), status_code=500)


class _CountResponses:
    """ASGI middleware: counts every response by route and status code (metrics.responses)."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_response(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counted)


# THE PROCESS --------------------------------------------------------------------------------------------------


def serve(run_dir: Path, *, host: str = DEFAULT_HOST, port: int = 8000, api_key: str | None = None,
          kv_memory_gib: float | None = None, page_size: int | None = None, max_seqs: int = 16,
          max_tokens_per_step: int | None = None, max_queue: int = 64, prefix_caching: bool = True,
          mesh_tensor: int = 1, kv_cache: str = "auto", grace_s: float = 20.0, quantize: str | None = None) -> None:
    """Serves the lm run `run_dir` until SIGTERM or Ctrl-C. Binds `host` (loopback by default; any other address
    needs `api_key`) and `port` (0: a free one); prints the address once the model is loaded and compiled. At most
    `max_seqs` requests generate together and `max_queue` more wait; past that a request gets 429. The engine
    settings (kv_memory_gib ... kv_cache, quantize) are `InferenceEngine.from_run`'s."""
    check_settings(host=host, port=port, api_key=api_key, max_queue=max_queue, grace_s=grace_s)
    from systolic.workloads.lm.serve.engine import InferenceEngine

    engine = InferenceEngine.from_run(Path(run_dir), kv_memory_gib=kv_memory_gib, page_size=page_size,
                                      max_seqs=max_seqs, max_tokens_per_step=max_tokens_per_step,
                                      prefix_caching=prefix_caching, mesh_tensor=mesh_tensor, kv_cache=kv_cache,
                                      quantize=quantize)
    start = time.perf_counter()
    programs = engine.warmup(progress=lambda line: print(line, file=sys.stderr, flush=True))  # no silent minutes
    warmup_s = time.perf_counter() - start
    info = ModelInfo(engine.model_name, engine.max_context, engine.tokenizer, engine.chat_template, engine.eos_ids,
                     _tokenizer_folder(Path(run_dir), engine.tokenizer))
    metrics = ServeMetrics()
    driver = EngineDriver(engine, capacity=max_seqs + max_queue, on_stats=metrics.observe_engine)
    sock = _listen(host, port)
    url = _url(host, sock.getsockname()[1])
    driver.start()
    server = _uvicorn_server(make_app(info, driver, metrics, api_key=api_key), driver, grace_s)
    previous = _stop_on_signals(server)  # before the line below: a client may stop the server as soon as it reads it
    print(f"serving {info.name} (context {info.max_context} tokens) at {url}/v1 (OpenAI API), metrics at "
          f"{url}/metrics; every step size compiled ({programs} programs, warm-up {warmup_s:.1f} s); SIGTERM or "
          "Ctrl-C stops it", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        driver.stop()
        sock.close()
    print("stopped", flush=True)


def _tokenizer_folder(run_dir: Path, tokenizer: Tokenizer) -> str | None:
    """The run's tokenizer as Hugging Face tooling loads it, written when the run lacks it; None (and a note) when
    the run directory is read-only."""
    from systolic.data import hf_tokenizer

    try:
        return str(hf_tokenizer.write(run_dir, tokenizer).absolute())
    except OSError as e:
        print(f"note: cannot write the run's tokenizer for Hugging Face tooling ({e}); clients that tokenize for "
              f"themselves (lm-evaluation-harness) need it: run `systolic serve` once with write access to {run_dir}",
              flush=True)
        return None


def check_settings(*, host: str, port: int, api_key: str | None, max_queue: int, grace_s: float) -> None:
    """The server's own settings (the engine checks its own), before anything slow."""
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key is empty. Fix: pass the key that clients must send (a long random string, e.g. "
                        "from `python -c \"import secrets; print(secrets.token_urlsafe())\"`).")
    if api_key is None and not is_loopback(host):
        raise UserError(
            f"--host {host} would let other machines reach the server, but no --api-key is set, so anyone who can "
            "reach the port could use it. Fix: add --api-key KEY (clients send it as a Bearer token), or keep the "
            f"default --host {DEFAULT_HOST}.")
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port. Expected 0 to 65535 (0: any free port). Fix: e.g. --port "
                        "8000.")
    if max_queue < 0 or not grace_s >= 0:
        raise UserError(f"--max-queue {max_queue} and --grace-s {grace_s} must be at least 0. Fix: e.g. --max-queue "
                        "64 --grace-s 20.")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening, so clients that connect before uvicorn starts wait in its
    backlog instead of being refused."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        return sock
    except OSError as e:
        fix = ("another process listens on it: stop it, or pick another --port (0: any free one)"
               if e.errno == errno.EADDRINUSE else "pass an address of this machine, e.g. --host 127.0.0.1")
        raise UserError(f"Cannot listen on {host} port {port}: {e.strerror or e}. Fix: {fix}.") from None


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(app: Starlette, driver: EngineDriver, grace_s: float) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # The driver ends what is left at the grace period's end with an error event, so every stream closes
            # properly; uvicorn's own timeout, a little later, is only the backstop.
            driver.drain(grace_s)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=grace_s + SHUTDOWN_MARGIN_S)
    return Server(config)


def _stop_on_signals(server: Any) -> dict:
    """SIGINT and SIGTERM stop `server` gracefully from now on: before it runs (it then starts and stops at once,
    where the default handler would have killed the process, exit code -15) and after, when uvicorn, having run with
    its own handlers, restores these and raises the signal again (to die "as the signal would have"): it lands here,
    so the stop is an ordinary return, exit code 0. -> the handlers found, to restore. Only the main thread can set
    handlers; elsewhere (tests) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
