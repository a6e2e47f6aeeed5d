"""`systolic serve` over real HTTP: the server started through `serve()` in a subprocess on a free loopback port,
talked to with the `openai` client unchanged (completions, chat, streaming) and with raw httpx requests for every
kind of bad input; a client that disconnects frees its pages (seen through /metrics); a full queue answers 429;
SIGTERM lets the request in flight finish and exits 0; `systolic generate --kv-cache int8` on the same model.

The model: a tiny random Llama (2 layers, 256 positions) with a byte-level BPE and a ChatML chat template, written
as a Hugging Face folder without torch and imported with `systolic convert from-hf`."""

import concurrent.futures
import json
import math
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tiny_hf import write_hf_tokenizer

from systolic.cli import main
from systolic.data.bpe import BPETokenizer
from systolic.data.chat import ChatTemplate
from systolic.errors import UserError
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.hf import config as hf_config
from systolic.workloads.lm.hf import convert as hf

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from systolic.workloads.lm.serve import server  # noqa: E402

from serve_process import KEY, START_TIMEOUT_S, STOP_TIMEOUT_S, Server, running  # noqa: E402

VOCAB = 320
CONTEXT = 256
MODEL = ModelConfig(d_model=64, layers=2, heads=4, kv_heads=2, max_seq_len=CONTEXT, vocab_size=VOCAB)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# A hostile branch before it: a conversation whose last message is "spin" runs two loops of 10**10 steps, which the
# template's time budget stops (data/template_sandbox.py) with a 400 for that request alone.
SPIN = ("{% if messages[-1]['content'] == 'spin' %}{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
        "{% endfor %}{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """An lm run imported from a Hugging Face folder: random weights (std 0.2, so greedy choices have no near-ties)
    and a ChatML tokenizer trained here."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("serve-model")
    texts = ["system user assistant Be brief. What is the capital? Once upon a time"] * 20
    folder = write_hf_tokenizer(root / "hf", texts, SPECIALS, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                                SPIN + CHATML, vocab_size=300)
    specials = [Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(t) for t in SPECIALS]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(0, 0.2, x.shape).astype(np.float32), hf.abstract_params(MODEL, VOCAB))

    def never_special(make):  # zero logits for the special tokens: never the argmax, so greedy replies never stop
        def made():
            weight = make()  # (V, d)
            weight[specials] = 0.0
            return weight
        return made

    tensors = [(name, shape, never_special(make) if name == "lm_head.weight" else make)
               for name, shape, make in hf.export_tensors(MODEL, params)]
    assert "lm_head.weight" in [name for name, _, _ in tensors]
    hf.write_safetensors(folder, tensors, 1 << 30)
    (folder / "config.json").write_text(json.dumps(hf_config.hf_config(MODEL, VOCAB, {})))
    assert main(["convert", "from-hf", str(folder), str(root / "run")]) == 0
    return root / "run"


# One engine configuration for every server here: the session's compile cache compiles its programs once.
SETTINGS = {"api_key": KEY, "max_seqs": 4, "max_queue": 2, "max_tokens_per_step": 32}  # 3 step sizes: 8, 16, 32


@pytest.fixture(scope="module")
def srv(run_dir, tmp_path_factory):
    with running(run_dir, tmp_path_factory.mktemp("log") / "server.log", **SETTINGS) as s:
        yield s


@pytest.fixture(scope="module")
def model(srv) -> str:
    return srv.client().models.list().data[0].id


def test_the_warm_up_says_each_program_it_compiles(srv):
    """Before its address the server compiles every step program, each said on stderr with the time so far; the
    start-up line says how many and the warm-up's time."""
    lines = [line for line in srv.log.read_text().splitlines() if line.startswith("warm-up: ")]
    total = int(lines[-1].split(" of ")[1].split()[0])
    assert total >= 3 and len(lines) == total  # at least the 3 step sizes of SETTINGS, each with its page readings
    assert [int(line.split()[3]) for line in lines] == list(range(1, total + 1))
    assert all(line.endswith(" s") for line in lines)
    start = next(line for line in srv.lines if "serving " in line)
    seconds = float(start.split(f"every step size compiled ({total} programs, warm-up ")[1].split(" s)")[0])
    assert seconds >= float(lines[-1].rsplit("; ", 1)[1].removesuffix(" s"))


def test_a_sigterm_right_after_the_start_up_line_stops_the_server_cleanly(run_dir, tmp_path):
    """A supervisor may stop the server as soon as it reads its address: `running` sends SIGTERM then and wants exit
    code 0 and no traceback (the handlers were set only later, just before uvicorn ran: the process died of the
    signal, -15)."""
    with running(run_dir, tmp_path / "server.log", **SETTINGS):
        pass


# THE OPENAI CLIENT --------------------------------------------------------------------------------------------


def test_completions_with_the_openai_client(srv, model, run_dir):
    client = srv.client()
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                      logprobs=0)
    choice = whole.choices[0]
    assert whole.object == "text_completion" and whole.model == model and whole.id.startswith("cmpl-")
    assert choice.finish_reason in ("length", "stop") and isinstance(choice.text, str)
    n = whole.usage.completion_tokens
    assert (n == 12) == (choice.finish_reason == "length") and 1 <= n <= 12
    tokenizer = BPETokenizer.load(run_dir / "tokenizer.json")
    assert whole.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + n
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == n
    assert all(lp <= 0 and math.isfinite(lp) for lp in choice.logprobs.token_logprobs)
    assert choice.logprobs.text_offset[0] == 0

    # Streaming gives the same greedy text, in chunks, then the usage chunk.
    chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_chat_with_the_openai_client(srv, model, run_dir):
    client = srv.client()
    whole = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=10, temperature=0)
    message = whole.choices[0].message
    assert whole.object == "chat.completion" and message.role == "assistant" and isinstance(message.content, str)
    template = ChatTemplate.load(run_dir, BPETokenizer.load(run_dir / "tokenizer.json"))
    assert whole.usage.prompt_tokens == len(template.encode(CONVERSATION, add_generation_prompt=True))
    assert 1 <= whole.usage.completion_tokens <= 10

    chunks = list(client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=10, temperature=0,
                                                 stream=True, logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == whole.usage.completion_tokens and all(t.logprob <= 0 for t in tokens)


def test_seed_and_stop(srv, model):
    client = srv.client()
    sample = [client.completions.create(model=model, prompt="Once", max_tokens=16, temperature=1.0, seed=7)
              for _ in range(2)]
    assert sample[0].choices[0].text == sample[1].choices[0].text
    greedy = client.completions.create(model=model, prompt="Once", max_tokens=16, temperature=0).choices[0].text
    stop = greedy[4:6]
    assert stop.strip(), f"pick a stop string from the greedy text {greedy!r}"
    cut = client.completions.create(model=model, prompt="Once", max_tokens=16, temperature=0, stop=[stop]).choices[0]
    assert cut.text == greedy[: greedy.index(stop)] and cut.finish_reason == "stop"


def test_models_health_and_metrics(srv, model):
    hits = srv.metrics()["systolic_prefix_cache_hit_tokens_total"]
    for _ in range(2):  # the second finds the first's full pages in the prefix cache
        srv.client().completions.create(model=model, prompt="Once upon a time " * 8, max_tokens=2)
    assert srv.metrics()["systolic_prefix_cache_hit_tokens_total"] >= hits + 16
    assert srv.get("/health").json() == {"status": "ok"}
    card = srv.get(f"/v1/models/{model}").json()
    assert card["id"] == model and card["max_model_len"] == CONTEXT
    metrics = srv.metrics()
    assert metrics["systolic_generation_tokens_total"] > 0 and metrics["systolic_kv_pages_total"] > 0
    assert metrics["systolic_time_to_first_token_seconds_count"] > 0
    assert metrics["systolic_http_responses_total{code=200,route=/v1/completions}"] > 0


# BAD INPUT ----------------------------------------------------------------------------------------------------

LONG = "Once upon a time " * 200  # far past 256 tokens


def bad_inputs(model: str):
    """(path, body, raw bytes or None, extra headers, status, the error's param, its code)."""
    ok = {"model": model, "prompt": "Hi", "max_tokens": 4}
    chat = {"model": model, "messages": CONVERSATION, "max_tokens": 4}
    return [
        ("/v1/completions", None, b"{not json", None, 400, None, None),
        ("/v1/completions", None, b"\xff\xfe\x00garbage", None, 400, None, None),
        ("/v1/completions", None, b'{"model": "' + model.encode() + b'", "prompt": "Hi", "temperature": NaN}', None,
         400, "temperature", None),
        ("/v1/completions", None, b'{"model": "' + model.encode() + b'", "prompt": "Hi", "top_p": Infinity}', None,
         400, "top_p", None),
        ("/v1/completions", None, b'{"model": "' + model.encode() + b'", "prompt": "Hi", "temperature": 1e999}', None,
         400, "temperature", None),
        ("/v1/completions", [ok], None, None, 400, None, None),
        ("/v1/completions", {"prompt": "Hi"}, None, None, 400, "model", None),
        ("/v1/completions", {**ok, "model": "gpt-4"}, None, None, 404, "model", "model_not_found"),
        ("/v1/chat/completions", {**chat, "model": "gpt-4"}, None, None, 404, "model", "model_not_found"),
        ("/v1/completions", {**ok, "prompt": LONG}, None, None, 400, "prompt", "context_length_exceeded"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": LONG}]}, None, None, 400,
         "messages", "context_length_exceeded"),
        ("/v1/completions", {**ok, "max_tokens": CONTEXT}, None, None, 400, "max_tokens", "context_length_exceeded"),
        ("/v1/completions", {**ok, "max_tokens": 0}, None, None, 400, "max_tokens", None),
        ("/v1/completions", {**ok, "max_tokens": "8"}, None, None, 400, "max_tokens", None),
        ("/v1/completions", {**ok, "max_tokens": True}, None, None, 400, "max_tokens", None),
        ("/v1/completions", {**ok, "temperature": -1}, None, None, 400, "temperature", None),
        ("/v1/completions", {**ok, "seed": -3}, None, None, 400, "seed", None),
        ("/v1/completions", {**ok, "n": 17}, None, None, 400, "n", None),
        ("/v1/completions", {**ok, "n": 2, "best_of": 1}, None, None, 400, "best_of", None),
        ("/v1/completions", {**ok, "best_of": 2, "stream": True}, None, None, 400, "best_of", None),
        ("/v1/completions", {**ok, "logprobs": 21}, None, None, 400, "logprobs", None),
        ("/v1/completions", {**ok, "repetition_penalty": 1.2}, None, None, 400, "repetition_penalty", None),
        ("/v1/completions", {**ok, "stop_token_ids": ["a"]}, None, None, 400, "stop_token_ids", None),
        ("/v1/completions", {**ok, "stream": True, "stream_options": {"chunk_size": 2}}, None, None, 400,
         "stream_options", None),
        ("/v1/completions", {**ok, "stop": ["a", ""]}, None, None, 400, "stop", None),
        ("/v1/completions", {**ok, "stream_options": {"include_usage": True}}, None, None, 400, "stream_options", None),
        ("/v1/completions", {**ok, "frobnicate": 1}, None, None, 400, "frobnicate", None),
        ("/v1/completions", {**ok, "prompt": ["a", 3]}, None, None, 400, "prompt", None),
        ("/v1/completions", {**ok, "prompt": ["a"] * 65}, None, None, 400, "prompt", None),
        ("/v1/completions", {**ok, "prompt": [1, 2, VOCAB * 10]}, None, None, 400, "prompt", None),
        ("/v1/chat/completions", {**chat, "messages": []}, None, None, 400, "messages", None),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "robot", "content": "Hi"}]}, None, None, 400,
         "messages[0].role", None),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None,
         None, 400, "messages[0].content", None),
        ("/v1/chat/completions", {**chat, "top_logprobs": 3}, None, None, 400, "top_logprobs", None),
        # Text that is not Unicode (a JSON escape of a lone surrogate), and a template stopped by its budget.
        ("/v1/completions", None, b'{"model": "' + model.encode() + b'", "prompt": "a\\ud800b"}', None, 400, "prompt",
         None),
        ("/v1/chat/completions", None, b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": '
         b'"\\udc80"}]}', None, 400, "messages", None),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "spin"}]}, None, None, 400,
         "messages", None),
        ("/v1/completions", ok, None, {"Authorization": "Bearer wrong"}, 401, None, "invalid_api_key"),
        ("/v1/nowhere", ok, None, None, 404, None, "not_found"),
    ]


def test_bad_input_gets_an_openai_error_and_the_server_goes_on(srv, model):
    for path, body, raw, headers, status, param, code in bad_inputs(model):
        response = srv.post(path, body, content=raw, headers=headers)
        where = f"{path} {raw or body!r:.120}"
        assert response.status_code == status, f"{where}: {response.status_code} {response.text}"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        assert error["message"] and "Traceback" not in response.text, where
        assert (error["param"], error["code"]) == (param, code), f"{where}: {error}"
    assert srv.get("/v1/completions").status_code == 405
    assert srv.get("/health").status_code == 200
    assert srv.client().completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def hostile_requests(model: str):
    """(path, body or raw bytes, status, the error's param) of requests that once failed other requests or got a
    500 (issue 45): values past the engine's int32 and float32 arrays, token ids past int64, roles that are not
    strings, a lone surrogate echoed back in the error."""
    ok = {"model": model, "prompt": "Once upon a time", "max_tokens": 6}
    chat = {"model": model, "messages": CONVERSATION, "max_tokens": 4}
    return [
        ("/v1/completions", {**ok, "top_k": 2**31, "temperature": 0.7}, 400, "top_k"),
        ("/v1/completions", {**ok, "top_k": 2**63, "temperature": 0.7}, 400, "top_k"),
        ("/v1/completions", {**ok, "temperature": 1e39}, 400, None),  # finite in float64, inf in float32
        ("/v1/completions", {**ok, "top_p": 1e-50, "temperature": 0.7}, 400, None),  # 0 in float32
        ("/v1/completions", {**ok, "prompt": [1, 2**63]}, 400, "prompt"),
        ("/v1/completions", {**ok, "prompt": [2**70]}, 400, "prompt"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": ["user"], "content": "Hi"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": {"a": 1}, "content": "Hi"}]}, 400, "messages[0].role"),
        ("/v1/completions", b'{"model": "\\ud800", "prompt": "Hi"}', 404, "model"),
        ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": "Hi", "\\udc00x": 1}', 400, "\\udc00x"),
    ]


def test_a_bad_request_fails_alone_and_the_requests_beside_it_get_their_tokens(srv, model):
    """Each hostile request gets its 4xx, sent together with a greedy request and a greedy stream that get their
    200 and the tokens they get alone; a top_k past the vocabulary (but within int32) keeps every id, as 0 does."""
    greedy = {"model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}

    def innocent() -> str:
        response = srv.post("/v1/completions", greedy)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    def innocent_stream() -> str:
        body = {**greedy, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=120) as r:
            assert r.status_code == 200
            lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
        assert lines[-1] == "[DONE]" and all("error" not in json.loads(x) for x in lines[:-1]), lines
        return "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1])

    def hostile(case) -> None:
        path, body, status, param = case
        response = srv.post(path, None, content=body) if isinstance(body, bytes) else srv.post(path, body)
        assert response.status_code == status, f"{body!r:.100}: {response.status_code} {response.text}"
        error = response.json()["error"]
        assert error["param"] == param and "Traceback" not in response.text, error

    alone = innocent()
    assert innocent_stream() == alone
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = [pool.submit(innocent), pool.submit(innocent_stream)]
        for future in [pool.submit(hostile, case) for case in hostile_requests(model)]:
            future.result()
        assert [f.result() for f in together] == [alone, alone]
    sampled = {**greedy, "temperature": 0.8, "seed": 3}
    texts = [srv.post("/v1/completions", {**sampled, "top_k": k}).json()["choices"][0]["text"] for k in (0, 2**31 - 1)]
    assert texts[0] == texts[1]
    assert srv.get("/health").status_code == 200


def test_openai_client_raises_its_own_errors(srv, model):
    client = srv.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model, prompt=LONG, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_client_that_disconnects_frees_its_pages(srv, model):
    before = srv.metrics()
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": CONTEXT - 16, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # generating: it holds pages now
        assert srv.metrics()["systolic_kv_pages_used"] > 0
    # The connection is closed: the server notices, cancels the request and gives its pages back.
    for _ in range(600):
        metrics = srv.metrics()
        if metrics["systolic_requests_running"] == 0 and metrics["systolic_kv_pages_used"] == 0:
            break
        time.sleep(0.05)
    assert metrics["systolic_requests_running"] == 0 and metrics["systolic_kv_pages_used"] == 0, metrics
    cancelled = "systolic_requests_finished_total{finish_reason=cancelled}"
    assert metrics.get(cancelled, 0) == before.get(cancelled, 0) + 1
    assert srv.client().completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


# LIMITS AND SHUTDOWN ------------------------------------------------------------------------------------------


def test_a_full_queue_answers_429(srv, model):
    """6 places (4 generating, 2 queued), 12 long requests at once: some are turned away, the server goes on."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": CONTEXT - 16, "temperature": 0}

    def call(_):
        response = srv.post("/v1/completions", body)
        return response.status_code, response.headers.get("retry-after"), response.json()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(call, range(12)))
    codes = sorted(code for code, _, _ in answers)
    assert set(codes) == {200, 429} and codes.count(200) >= 6, codes
    for code, retry_after, answer in answers:
        if code == 429:
            assert int(retry_after) >= 1 and answer["error"]["code"] == "queue_full", answer
        else:
            assert answer["usage"]["completion_tokens"] == CONTEXT - 16
    assert srv.metrics()["systolic_http_responses_total{code=429,route=/v1/completions}"] == codes.count(429)
    assert srv.post("/v1/completions", {**body, "max_tokens": 2}).status_code == 200


def test_sigterm_finishes_or_cancels_the_requests_in_flight_and_exits_0(run_dir, tmp_path):
    """Two streams in flight at SIGTERM: a short one finishes within the grace period; a long one finishes too or,
    if the grace period ends first (a slow machine), ends with OpenAI's error event. Both end with [DONE]."""
    s = Server(run_dir, tmp_path / "server.log", **SETTINGS, grace_s=10)
    model = s.client().models.list().data[0].id
    started = threading.Barrier(3)
    streams: dict[int, list[str]] = {}

    def stream(max_tokens: int) -> None:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, headers=s.headers, timeout=120) as response:
            lines = (line.removeprefix("data: ") for line in response.iter_lines() if line)
            streams[max_tokens] = [next(lines)]
            started.wait()
            streams[max_tokens] += list(lines)

    threads = [threading.Thread(target=stream, args=(n,)) for n in (4, CONTEXT - 16)]
    for thread in threads:
        thread.start()
    started.wait(START_TIMEOUT_S)  # both are generating
    s.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(STOP_TIMEOUT_S)
    assert s.process.wait(STOP_TIMEOUT_S) == 0, s.log.read_text()[-5000:]
    assert "Traceback" not in s.log.read_text()
    with pytest.raises(httpx.ConnectError):
        s.get("/health")
    short, long = streams[4], streams[CONTEXT - 16]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["usage"]["completion_tokens"] == 4
    assert long[-1] == "[DONE]"
    last = json.loads(long[-2])
    if "error" in last:  # cancelled at the end of the grace period
        assert last["error"]["type"] == "server_error" and "shut down" in last["error"]["message"]
    else:
        assert last["usage"]["completion_tokens"] == CONTEXT - 16


# SETTINGS -----------------------------------------------------------------------------------------------------


def test_other_hosts_need_an_api_key(tmp_path):
    with pytest.raises(UserError, match="--api-key"):
        server.serve(tmp_path, host="0.0.0.0")
    with pytest.raises(UserError, match="empty"):
        server.serve(tmp_path, api_key=" ")
    assert server.is_loopback("::1") and server.is_loopback("localhost") and not server.is_loopback("example.com")


def test_command_line_options_reach_serve(monkeypatch, tmp_path):
    from systolic.workloads.lm.serve.command import API_KEY_ENV

    seen = {}
    monkeypatch.setattr(server, "serve", lambda run_dir, **kwargs: seen.update(run_dir=run_dir, **kwargs))
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert main(["serve", str(tmp_path), "--port", "0", "--max-seqs", "2", "--no-prefix-caching"]) == 0
    assert seen == {"run_dir": tmp_path, "host": "127.0.0.1", "port": 0, "api_key": "from-env", "kv_memory_gib": None,
                    "page_size": None, "max_seqs": 2, "max_tokens_per_step": None, "max_queue": 64,
                    "prefix_caching": False, "mesh_tensor": 1, "kv_cache": "auto", "grace_s": 20.0, "quantize": None}
    assert main(["serve", str(tmp_path), "--kv-cache", "int8"]) == 0 and seen["kv_cache"] == "int8"
    assert main(["serve", str(tmp_path), "--page-size", "32"]) == 0 and seen["page_size"] == 32
    assert main(["serve", str(tmp_path), "--quantize", "w8a8"]) == 0 and seen["quantize"] == "w8a8"


def test_generate_with_an_int8_kv_cache(run_dir, capsys):
    """`systolic generate --kv-cache int8` on the served model, greedy: the reply float's cache gives (this model's
    std-0.2 weights leave no near-ties for int8's error to flip)."""
    replies = {}
    for kv_cache in ("auto", "int8"):
        assert main(["generate", str(run_dir), "--prompt", "Once upon a time", "--max-new-tokens", "12",
                     "--temperature", "0", "--kv-cache", kv_cache]) == 0
        replies[kv_cache] = capsys.readouterr().out
    assert replies["int8"] == replies["auto"] and len(replies["auto"]) > len("Once upon a time\n")


def test_n_best_of_and_vllms_sampling_fields(srv, model, run_dir):
    post = lambda **body: srv.post("/v1/completions", {"model": model, "prompt": "Once", **body}).json()  # noqa: E731
    several = post(max_tokens=6, temperature=1.0, seed=3, n=3)
    texts = [c["text"] for c in several["choices"]]
    assert [c["index"] for c in several["choices"]] == [0, 1, 2] and len(set(texts)) > 1
    # choice j draws from seed + j: the same text as a request of its own with that seed
    assert texts[2] == post(max_tokens=6, temperature=1.0, seed=5)["choices"][0]["text"]
    best = post(max_tokens=6, temperature=1.0, seed=3, n=1, best_of=3, logprobs=0)["choices"]
    sums = [sum(post(max_tokens=6, temperature=1.0, seed=3 + j, logprobs=0)["choices"][0]["logprobs"]
                ["token_logprobs"]) for j in range(3)]
    assert len(best) == 1 and best[0]["text"] == texts[int(np.argmax(sums))]
    batch = post(prompt=["Once", [1, 2, 3]], max_tokens=2, n=2, temperature=0)["choices"]
    assert [c["index"] for c in batch] == [0, 1, 2, 3] and batch[0]["text"] == batch[1]["text"]

    # vLLM's fields as load generators send them together (guidellm's ignore_eos: test_clients.py).
    im_end = BPETokenizer.load(run_dir / "tokenizer.json").token_id("<|im_end|>")
    long = post(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[im_end], min_tokens=8)["choices"][0]
    assert long["finish_reason"] == "length"
    greedy = post(max_tokens=16, temperature=0)["choices"][0]["text"]
    stop = greedy[4:6]
    kept = post(max_tokens=16, temperature=0, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"]
    assert kept == greedy[: greedy.index(stop) + len(stop)]

    # ignore_eos: a sampled end token (no seed: any run may draw one) would end a choice early, its count short
    events = srv.post("/v1/completions", {"model": model, "prompt": "Once", "max_tokens": 5, "stream": True, "n": 2,
                                          "ignore_eos": True,
                                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [json.loads(line[6:]) for line in events.text.splitlines() if line.startswith("data: {")]
    assert all("usage" in c for c in chunks) and chunks[-1]["usage"]["completion_tokens"] == 10
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
