"""`systolic serve` in a subprocess for the tests that talk to it over HTTP (tests/workloads/lm/serve/test_server.py,
test_clients.py): `serve()` on a free loopback port, its address read from the line it prints once it listens."""

import contextlib
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

KEY = "test-key"
START_TIMEOUT_S = 600  # loading and compiling the engine's programs on a busy 2-core machine
STOP_TIMEOUT_S = 120


class Server:
    """`serve()` in a subprocess; its address is read from the line it prints once it listens."""

    def __init__(self, run_dir: Path, log: Path, **settings):
        # As the CLI does before a command: the compile cache (the session's, conftest.py), so that a second server
        # of the same engine settings compiles nothing.
        code = ("import json, sys; from systolic.runtime import compile_cache; compile_cache.enable(); "
                "from systolic.workloads.lm.serve.server import serve; serve(sys.argv[1], **json.loads(sys.argv[2]))")
        self.log = log
        self.process = subprocess.Popen([sys.executable, "-c", code, str(run_dir), json.dumps({"port": 0, **settings})],
                                        stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        self.lines: list[str] = []
        listening = threading.Event()

        def read() -> None:  # keeps draining stdout so the server never blocks on a full pipe
            for line in self.process.stdout:
                self.lines.append(line)
                if "serving " in line:
                    listening.set()
            listening.set()

        threading.Thread(target=read, daemon=True).start()
        if not listening.wait(START_TIMEOUT_S) or self.process.poll() is not None:
            self.process.kill()
            pytest.fail(f"the server did not start:\n{''.join(self.lines)}\n{log.read_text()[-5000:]}")
        line = next(line for line in self.lines if "serving " in line)
        self.url = line.split(" at ")[1].split("/v1")[0]
        self.headers = {"Authorization": f"Bearer {settings['api_key']}"} if settings.get("api_key") else {}

    def client(self, **kwargs) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120, **kwargs)

    def post(self, path: str, body: object = None, *, content: bytes | None = None, headers=None) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body if content is None else None, content=content,
                          headers={**self.headers, **(headers or {})}, timeout=120)

    def get(self, path: str, *, headers=None) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers={**self.headers, **(headers or {})}, timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels, e.g. 'systolic_requests_finished_total{finish_reason=stop}'."""
        out = {}
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            pytest.fail(f"the server did not stop within {STOP_TIMEOUT_S} s after SIGTERM")


@contextlib.contextmanager
def running(run_dir: Path, log: Path, **settings):
    """A Server for the `with` block; it must then stop with exit code 0 and no traceback in its log."""
    s = Server(run_dir, log, **settings)
    yield s
    assert s.stop() == 0, s.log.read_text()[-5000:]
    assert "Traceback" not in s.log.read_text(), s.log.read_text()[-5000:]
