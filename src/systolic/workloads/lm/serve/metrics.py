"""What `systolic serve` reports at GET /metrics, in Prometheus' text format (prometheus_client).

Counters: HTTP responses by route and status code, prompt and generated tokens, finished requests by finish
reason (stop, length, cancelled: a client that went away or a shutdown), preemptions (a sequence sent back to the
queue when pages ran out, recomputed later) and prompt tokens found in the prefix cache. Histograms, per request:
time to first token (from the request's arrival, queueing included), time per output token after the first
((last - first) / (tokens - 1)) and the whole request's latency. Gauges, from the engine after every step: requests
running and waiting (the queue), KV-cache pages held by requests, kept for their prefix (free to take, reusable by
a request with the same beginning) and in the pool, and the tokens of the last step.

Each server has its own registry (not prometheus_client's global one), so several can live in one process.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets in seconds: from a fast CPU's or accelerator's milliseconds to a long queue's minute (vLLM's ranges).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    """The server's metrics and its registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.responses = Counter("systolic_http_responses", "HTTP responses, by route and status code",
                                 ["route", "code"], registry=r)
        self.prompt_tokens = Counter("systolic_prompt_tokens", "Prompt tokens of the requests taken", registry=r)
        self.generation_tokens = Counter("systolic_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("systolic_requests_finished", "Requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("systolic_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("systolic_time_per_output_token_seconds",
                              "Per request: the mean time between its output tokens after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.latency = Histogram("systolic_request_latency_seconds", "From a request's arrival to its last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("systolic_requests_running", "Requests in the engine's batch", registry=r)
        self.waiting = Gauge("systolic_requests_waiting", "Requests queued for a place in the batch", registry=r)
        self.kv_pages_used = Gauge("systolic_kv_pages_used", "KV-cache pages held by requests", registry=r)
        self.kv_pages_cached = Gauge("systolic_kv_pages_cached", "KV-cache pages held by no request, kept for the "
                                     "prefix cache (taken back first when the pool runs out)", registry=r)
        self.kv_pages_total = Gauge("systolic_kv_pages_total", "KV-cache pages in the pool", registry=r)
        self.batch_size = Gauge("systolic_batch_size", "Tokens in the engine's last step (prompt chunks and one per "
                                "decoding request)", registry=r)
        self.preemptions = Counter("systolic_preemptions", "Requests sent back to the queue when KV pages ran out "
                                   "(recomputed later)", registry=r)
        self.prefix_hit_tokens = Counter("systolic_prefix_cache_hit_tokens", "Prompt tokens whose KV pages came "
                                         "from the prefix cache", registry=r)
        self._engine_totals = {"preemptions": 0, "prefix_hit_tokens": 0}  # the engine's counts at the last update

    def count_response(self, path: str, status: int) -> None:
        self.responses.labels(path if path in ROUTES else "other", str(status)).inc()

    def observe_engine(self, stats: dict[str, Any], inbox: int) -> None:
        """The engine's `stats()` and the requests submitted but not yet given to it (they wait too)."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"] + inbox)
        self.kv_pages_used.set(stats["kv_pages_used"])
        self.kv_pages_cached.set(stats["kv_pages_cached"])
        self.kv_pages_total.set(stats["kv_pages_total"])
        self.batch_size.set(stats["batch_size"])
        for name, counter in (("preemptions", self.preemptions), ("prefix_hit_tokens", self.prefix_hit_tokens)):
            counter.inc(stats[name] - self._engine_totals[name])  # the engine counts from its start, as a counter does
            self._engine_totals[name] = stats[name]

    def start_request(self, prompt_tokens: int) -> RequestTimer:
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTimer(self)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's timings, from its arrival (when it is made) to its last token."""

    def __init__(self, metrics: ServeMetrics):
        self._metrics = metrics
        self._start = time.perf_counter()
        self._first: float | None = None
        self._last = self._start
        self.tokens = 0
        self.done = False

    def tokens_arrived(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self._first is None:
            self._first = now
            self._metrics.ttft.observe(now - self._start)
        self._last = now
        self.tokens += n
        self._metrics.generation_tokens.inc(n)

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        self._metrics.finished.labels(reason).inc()
        self._metrics.latency.observe(time.perf_counter() - self._start)
        if self._first is not None and self.tokens > 1:
            self._metrics.tpot.observe((self._last - self._first) / (self.tokens - 1))
