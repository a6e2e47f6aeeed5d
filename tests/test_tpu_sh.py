"""benchmarks/harness/tpu.sh without a chip: its dry run (SYSTOLIC_TPU_SH_DRY_RUN=1) runs every part's wiring on CPU
with tiny models, as the chip runs them; without the dry run it refuses a machine where JAX sees no TPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TPU_SH = "benchmarks/harness/tpu.sh"  # from the repository root, as the chip's device tool calls it


def tpu_sh(tmp_path: Path, *parts: str, **env: str) -> subprocess.CompletedProcess:
    # One device, as on the chip: not the 8 fake CPU devices of tests/conftest.py (tiny batches of 4).
    one_device = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                          if not f.startswith("--xla_force_host_platform_device_count"))
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"), SYSTOLIC_TPU_SH_SITE=str(tmp_path / "site"),
               SYSTOLIC_TPU_SH_TESTS="tests/tpu", XLA_FLAGS=one_device,  # the test part: tests/tpu alone, quicker
               JAX_NUMPY_DTYPE_PROMOTION="standard", **env)  # as users run (tests/tpu/test_checkpoints.py says why)
    return subprocess.run(["bash", TPU_SH, *parts], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
def test_dry_run_runs_every_part(tmp_path: Path):
    # The wiring, not the chip's clock: on a loaded 2-core host the parts before sim took 460 of the 480 s.
    proc = tpu_sh(tmp_path, SYSTOLIC_TPU_SH_DRY_RUN="1", SYSTOLIC_TPU_SH_BUDGET_S="1800")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "pytest.xml", "serve-engine.jsonl", "sim.jsonl", "tpu-bench.jsonl", "tpu-bench.log", "tpu-bench.txt"]  # of 8
    env, *rows = [json.loads(line) for line in (out / "tpu-bench.jsonl").read_text().splitlines()]
    assert env["dry_run"] and env["backend"] == "cpu"
    assert env["parts"] == ["test", "train", "serve", "serve-int8", "serve-steps", "rl", "sim",
                           "gan"]
    status = {(r["part"], r["row"]): r["status"] for r in rows}
    assert status.pop(("train", "llama-1b-v5e")) in ("ok", "skipped")  # skipped: "recipe not found" until it lands
    assert set(status.values()) == {"ok"}, status
    train = [r for r in rows if r["part"] == "train" and r["status"] == "ok"]
    assert all(r["step_time_s"] > 0 and r["mfu"] > 0 and r["attention"] == "xla" for r in train)
    for part in ("serve", "serve-int8", "serve-steps"):
        (serve,) = [r for r in rows if r["part"] == part]
        assert [level["in_flight"] for level in serve["levels"]] == [1, 4]
    assert all(r["throughput"] > 0 for r in rows if r["part"] in ("sim", "gan") and "results" not in r)
    sim = [x for r in rows if r["part"] == "sim" for x in r.get("results", [])]  # the benchmark scripts' sizes
    assert [x["n"] for x in sim] == [64, 16, 32] and all(x.get("systolic_steps_per_s", x.get("steps_per_s")) > 0
                                                         for x in sim)
    rl = [r["vs_purejaxrl"] for r in rows if r["part"] == "rl"]
    assert len(rl) == 3 and all(v[side]["env_steps_per_s"] > 0 for v in rl for side in ("systolic", "purejaxrl"))
    assert "rl.unroll=3" in rl[2]["overrides"]  # the unrolled row's key reached the benchmark
    table = (out / "tpu-bench.txt").read_text()
    assert table in proc.stdout and "gpt2-124m" in table and "env steps/s" in table and "img/s" in table
    assert "jax-cfd" in table and "of the step" in table


def test_without_a_tpu_it_says_so_and_exits_2(tmp_path: Path):
    proc = tpu_sh(tmp_path, "train", JAX_PLATFORMS="cpu")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "JAX sees no TPU" in proc.stderr and "SYSTOLIC_TPU_SH_DRY_RUN=1" in proc.stderr


def test_the_gan_rows_mfu_reaches_the_table(monkeypatch):
    """On the chip a gan run's throughput line ends with its MFU (a CPU has no data-sheet peak, so the dry run shows
    none): the row reads it and the table shows it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "harness"))
    import tpu_bench

    line = "throughput: 1,234 img/s; first step (compile) 40.1 s; wall time 80.2 s; MFU 12.3%"
    assert tpu_bench.THROUGHPUT.search(line).groups() == ("1,234", "img/s", "40.1", "80.2")
    assert tpu_bench.MFU.search(line)[1] == "12.3" and tpu_bench.MFU.search(line.rpartition(";")[0]) is None
    row = {"part": "gan", "row": "gan-dcgan-64", "status": "ok", "throughput": 1234.0, "unit": "img/s",
           "compile_s": 40.1, "run_wall_s": 80.2, "mfu": 0.123, "wall_s": 90.0}
    assert tpu_bench.report([row]) == "gan    gan-dcgan-64: 1,234 img/s, MFU 12.3%, first (compile) 40.1 s, run 80.2 s"


def test_env_runs_a_command_in_the_benchmarks_environment(tmp_path: Path):
    # The chip's probes (benchmarks/peers/rl_profile.py, kernels/splash_blocks.py) need the carried wheels and src/
    # on the path.
    code = "import os, systolic; print(systolic.__file__); print(os.environ['PYTHONPATH'].split(os.pathsep)[0])"
    proc = tpu_sh(tmp_path, "env", sys.executable, "-c", code, SYSTOLIC_TPU_SH_DRY_RUN="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    module, first = proc.stdout.split("\n")[-3:-1]
    assert module == str(ROOT / "src" / "systolic" / "__init__.py") and first == str(ROOT / "src")
