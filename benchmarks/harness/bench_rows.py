"""The machinery that the accelerator harnesses share (gpu_bench.py, tpu_bench.py, beside this file): a preflight in
a child process, `systolic bench lm` rows run one process each under a time budget, and the rows' table; and the
timer of the side-by-side microbenchmarks (benchmarks/kernels/paged_attention.py): several jitted calls alternating
round by round.

Each row is one `systolic bench lm --recipe R --json` process (a fresh process per row: each gets the whole chip,
and an out-of-memory row fails alone). A row that would start with too little of the budget left is reported as
skipped; its timeout is the smaller of its own and what is left.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "src" / "systolic" / "recipes"
# Enough text for the bench's batches (the default corpus: the standard library's .py files), read in seconds.
DATA = ["data.max_bytes=20000000"]
TINY_BATCH, TINY_SEQ = 4, 64


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    recipe: str
    batch_size: int | None  # None: the recipe's train.batch_size
    seq_len: int  # the recipe's data.seq_len
    steps: int
    attention: str  # model.attention
    timeout_s: float
    scan_layers: bool  # model.scan_layers
    extra: tuple[str, ...] = ()  # more overrides (model.layers=8, model.remat=dots)

    def attention_run(self, dry_run: bool) -> str:
        """model.attention as run: a dry run on CPU takes XLA's formulation where the chip takes a kernel (cuDNN's,
        or splash, which Pallas would interpret there, slowly)."""
        return "xla" if dry_run and self.attention in ("cudnn", "splash") else self.attention

    def overrides(self, dry_run: bool) -> list[str]:
        batch = [] if self.batch_size is None else [f"train.batch_size={self.batch_size}"]
        out = [*batch, f"model.attention={self.attention_run(dry_run)}",
               f"model.scan_layers={str(self.scan_layers).lower()}", *self.extra, *DATA]
        return out + (tiny(self.recipe) if dry_run else [])


def alternating_medians(fns: dict, args: tuple, rounds: int, reps: int) -> dict[str, float]:
    """Each of `fns` (name -> jitted function, compiled already) timed on `args`: `rounds` rounds, the sides in
    turn, reversed every other round (the machine's drift falls on both), each `reps` calls to their results being
    ready -> name -> the median seconds a call."""
    import jax

    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            start = time.perf_counter()
            for _ in range(reps):
                out = fns[name](*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / reps)
    return {name: statistics.median(t) for name, t in times.items()}


def tiny(recipe: str) -> list[str]:
    """The dry run's overrides: the recipe's family at 2 layers of width 64, sequences of 64 tokens, in bfloat16
    (as on the chip; `auto` would be float32 on CPU)."""
    shrink = ["model.dtype=bfloat16", "model.d_model=64", "model.layers=2", "model.heads=4",
              f"model.max_seq_len={TINY_SEQ}", "model.vocab_size=320", f"data.seq_len={TINY_SEQ}",
              f"train.batch_size={TINY_BATCH}", "data.max_bytes=300000", "data.val_percent=30"]
    return shrink + (["model.kv_heads=2", "model.mlp_dim=128"] if recipe.startswith("llama") else [])


# Run in a child process so that the harness never starts a JAX backend itself: on a GPU that would take
# (preallocate) the memory the rows need; on a TPU it would hold the chip, which one process at a time may open.
PREFLIGHT = r"""
import json, sys
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
info = {"python": sys.version.split()[0], "packages": {n: version(n) for n in sys.argv[1:]}}
import jax, grain, systolic
info.update(backend=jax.default_backend(), devices=[d.device_kind for d in jax.devices()],
            systolic=systolic.__file__)
print(json.dumps(info))
"""


def preflight(env: dict[str, str], packages: tuple[str, ...], fix: str) -> dict | None:
    """The Python, the packages' versions, JAX's backend and devices, read in a child process; None (with the
    reason on stderr, `fix` the way out) when that process fails."""
    try:
        pre = subprocess.run([sys.executable, "-c", PREFLIGHT, *packages], capture_output=True, text=True, env=env,
                             timeout=120)
    except subprocess.TimeoutExpired:
        print("preflight (import jax, list the devices) took over 120 s: the accelerator or its driver does not "
              "answer, or another program holds it.", file=sys.stderr)
        return None
    if pre.returncode != 0:
        print(f"preflight (import jax, grain and systolic) failed:\n{pre.stderr[-3000:]}\nFix: {fix}", file=sys.stderr)
        return None
    info = json.loads(pre.stdout.strip().splitlines()[-1])
    print(f"python {info['python']}; " + ", ".join(f"{k} {v}" for k, v in info["packages"].items() if v))
    print(f"backend {info['backend']}: {len(info['devices'])} x {info['devices'][0]}; systolic from {info['systolic']}")
    return info


def run_command(cmd: list[str], env: dict[str, str], timeout_s: float, log, title: str) -> tuple[str, str, float]:
    """Runs `cmd`, its output appended to `log` under `title`: (status "ok" | "failed" | "timeout", the stdout or
    the line that says what went wrong, wall seconds)."""
    log.write(f"=== {title}: {' '.join(cmd[1:])}\n")
    log.flush()
    t = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        log.write(_text(e.stdout) + _text(e.stderr) + f"\n=== timed out after {timeout_s:.0f} s\n")
        log.flush()
        return "timeout", f"over {timeout_s:.0f} s", time.monotonic() - t
    wall_s = time.monotonic() - t
    log.write(proc.stdout + proc.stderr + f"\n=== exit {proc.returncode} after {wall_s:.0f} s\n")
    log.flush()
    if proc.returncode != 0:
        return "failed", error_line(proc.stderr or proc.stdout), wall_s
    return "ok", proc.stdout, wall_s


def run_bench_row(row: Row, dry_run: bool, env: dict[str, str], left_s: float, min_row_s: float, log, *,
                  platform: str) -> dict:
    """One `systolic bench lm` row: the bench's JSON fields and the row's own, with "status" ok, failed, timeout
    or skipped (and "error": why)."""
    overrides = row.overrides(dry_run)
    cmd = [sys.executable, "-m", "systolic", "bench", "lm", "--recipe", row.recipe, "--json",
           "--steps", str(2 if dry_run else row.steps), *overrides]
    batch, seq = (TINY_BATCH, TINY_SEQ) if dry_run else (row.batch_size, row.seq_len)
    record = {"kind": "row", "row": row.name, "recipe": row.recipe, "attention": row.attention_run(dry_run),
              "scan_layers": row.scan_layers, "batch_size": batch, "seq_len": seq, "overrides": overrides,
              "command": " ".join(cmd[1:])}
    if not (RECIPES / f"{row.recipe}.yaml").is_file():
        return {**record, "status": "skipped", "error": f"recipe not found: {row.recipe}", "wall_s": 0.0}
    if left_s < min_row_s:
        return {**record, "status": "skipped", "error": f"budget: {left_s:.0f} s left", "wall_s": 0.0}
    status, out, wall_s = run_command(cmd, env, min(row.timeout_s, left_s), log, row.name)
    lines = out.strip().splitlines() if status == "ok" else []
    if status == "ok" and (not lines or not lines[-1].startswith("{")):
        status, out = "failed", "no JSON line on stdout"
    if status != "ok":
        return {**record, "status": status, "error": out, "wall_s": wall_s}
    result = json.loads(lines[-1])
    if result["platform"] != platform and not dry_run:  # e.g. the CLI chose the CPU
        return {**record, **result, "status": "failed", "error": f"ran on {result['platform']}", "wall_s": wall_s}
    return {**record, **result, "status": "ok", "wall_s": wall_s}


def _text(stream: bytes | str | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def error_line(stderr: str) -> str:
    """The line that says what went wrong: an out-of-memory first, else the last line."""
    boilerplate = ("For simplicity, JAX has removed", "----")  # what JAX prints after its exceptions
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith(boilerplate)]
    for line in lines:
        if "RESOURCE_EXHAUSTED" in line or "Out of memory" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def format_table(records: list[dict]) -> str:
    """The bench rows, one line each: compile time, step time, tokens/s, FLOP/s, MFU and peak memory."""
    head = (f"{'row':<18} {'attention':<9} {'layers':<6} {'batch x seq':>11} {'compile s':>9} {'step ms':>9} "
            f"{'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8}")
    lines = [head, "-" * len(head)]
    for r in records:
        layers = "scan" if r["scan_layers"] else "loop"
        shape = f"{r['batch_size'] or 'recipe'} x {r['seq_len']}"
        prefix = f"{r['row']:<18} {r['attention']:<9} {layers:<6} {shape:>11}"
        if r["status"] != "ok":
            lines.append(f"{prefix} {r['status'].upper()}: {r['error']}")
            continue
        gib = f"{r['peak_memory_bytes'] / 2**30:8.1f}" if r["peak_memory_bytes"] else f"{'n/a':>8}"
        tflops = f"{r['flops_per_s'] / 1e12:8.1f}" if r["flops_per_s"] else f"{'n/a':>8}"
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] else f"{'n/a':>6}"
        lines.append(f"{prefix} {r['compile_s']:9.1f} {r['step_time_s'] * 1e3:9.1f} {r['items_per_s']:10,.0f} "
                     f"{tflops} {mfu} {gib}")
    return "\n".join(lines)
