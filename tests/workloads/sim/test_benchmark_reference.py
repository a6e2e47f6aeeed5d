"""benchmarks/peers/sim_vs_numpy.py and sim3d_vs_numpy.py compare like with like: their NumPy solvers and systolic's
agree to round-off."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("x64")

BENCHMARK = Path(__file__).parents[3] / "benchmarks" / "peers" / "sim_vs_numpy.py"


def test_numpy_reference_matches_systolic_step_for_step():
    spec = importlib.util.spec_from_file_location("sim_vs_numpy", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.compare(32, steps=10, dtype="float64", repeats=1)
    assert result["max_rel_diff"] < 1e-12, result
    assert result["numpy_steps_per_s"] > 0 and result["systolic_steps_per_s"] > 0


def test_numpy_3d_reference_matches_systolic_step_for_step():
    spec = importlib.util.spec_from_file_location("sim3d_vs_numpy", BENCHMARK.with_name("sim3d_vs_numpy.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.compare(16, steps=5, dtype="float64", repeats=1)
    assert result["max_rel_diff"] < 1e-12, result
    assert result["numpy_s_per_step"] > 0 and result["systolic_s_per_step"] > 0
