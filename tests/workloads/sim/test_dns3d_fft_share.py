"""benchmarks/studies/dns3d_fft_share.py measures what it says: its FFT program does exactly the 3-D solver's transforms
(the script stops otherwise), 36 single-field real transforms a step, and its roofline bytes are those transforms'
inputs and outputs."""

import importlib.util
from pathlib import Path

BENCHMARK = Path(__file__).parents[3] / "benchmarks" / "studies" / "dns3d_fft_share.py"


def test_fft_program_does_the_steps_transforms():
    spec = importlib.util.spec_from_file_location("dns3d_fft_share", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    n = 16
    result = bench.measure(n, steps=2, repeats=1, bandwidth=1e9)
    assert result["ffts_per_step"] == 4 * (6 + 3)  # RK4 stages x (inverse of u and w, forward of u x w)
    half, cube = n * n * (n // 2 + 1), n**3  # a real transform's complex side keeps n/2 + 1 of the last axis
    inverse, forward = 6 * (half * 8 + cube * 4), 3 * (cube * 4 + half * 8)  # complex64 and float32 bytes
    assert result["fft_bytes_per_step"] == 4 * (inverse + forward)
    assert result["fft_roofline_ms_per_step"] == 1e3 * result["fft_bytes_per_step"] / 1e9
    assert 0 < result["fft_share"] and result["steps_per_s"] > 0
