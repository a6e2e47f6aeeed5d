"""`systolic launch`: start N local processes of one multi-process run (tests, debugging; like torchrun).

The coordinator listens on loopback. Output lines are prefixed with `[pI]`. The first process to fail stops
the run: the others are terminated (a survivor would otherwise hang in a collective until the heartbeat
timeout) and launch exits with the failure's code, naming the process. Ctrl-C is forwarded to every
process (they checkpoint and stop); a second Ctrl-C kills them.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from systolic.runtime.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(index: int, count: int, port: int, devices_per_process: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(count), ENV_PROCESS_ID: str(index),
                "PYTHONUNBUFFERED": "1"})
    if devices_per_process:
        # Fake CPU devices: each process gets its own count, replacing any inherited one.
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()
    stream.close()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(command: list[str], processes: int, devices_per_process: int | None = None) -> int:
    port = free_port()
    procs: list[subprocess.Popen] = []
    threads = []
    for i in range(processes):
        proc = subprocess.Popen([sys.executable, "-m", "systolic", *command], env=child_env(i, processes, port, devices_per_process),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                start_new_session=True)  # our Ctrl-C handling decides what reaches them
        procs.append(proc)
        print(f"[launch] process {i} started (pid {proc.pid})", flush=True)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, f"[p{i}] ", out), daemon=True)
            t.start()
            threads.append(t)

    # One waiter thread per process: the queue receives exits in the order they happen, so the process that
    # died first is the one named, not a peer that aborted a few milliseconds later because of it.
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for i, p in enumerate(procs):
        threading.Thread(target=lambda i=i, p=p: exits.put((i, p.wait())), daemon=True).start()

    interrupts = 0

    def on_sigint(signum, frame):
        nonlocal interrupts
        interrupts += 1
        sig = signal.SIGINT if interrupts == 1 else signal.SIGKILL
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    previous = signal.signal(signal.SIGINT, on_sigint)
    failed = None
    try:
        remaining = len(procs)
        while remaining:
            try:
                index, code = exits.get(timeout=0.5)  # a timeout keeps the wait interruptible by Ctrl-C
            except queue.Empty:
                continue
            remaining -= 1
            if code != 0:
                failed = (index, code)
                print(f"[launch] process {index} {describe_exit(code)}; stopping the others", file=sys.stderr, flush=True)
                _stop(procs)
                break
    finally:
        signal.signal(signal.SIGINT, previous)
        for t in threads:
            t.join(timeout=2)
    if failed is None:
        return 0
    return failed[1] if failed[1] > 0 else 128 - failed[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
