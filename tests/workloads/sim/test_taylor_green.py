"""The Taylor-Green reference curve as shipped, and how a run's dissipation peak is found and compared."""

import numpy as np
import pytest

from systolic.workloads.sim import taylor_green


def test_the_shipped_reference_is_the_512_cubed_dns_curve():
    ref = taylor_green.load_reference()
    assert ref.shape == (400, 3) and ref[0].tolist() == [0.0, 0.125, 0.00046874284]
    np.testing.assert_allclose(np.diff(ref[:, 0]), 0.05, atol=1e-9)
    # -dE/dt in the file is the derivative of its energy column: central differences agree to 2% everywhere.
    derivative = -np.gradient(ref[:, 1], ref[:, 0])
    np.testing.assert_allclose(derivative[1:-1], ref[1:-1, 2], rtol=0.02)
    # The peak found from every 5th row is the full file's (0.01285753 at t = 8.97, its header says).
    peak = taylor_green.reference_peak()
    assert peak.value == pytest.approx(0.01285753, rel=1e-4) and peak.time == pytest.approx(8.97, abs=0.01)


def test_peak_refines_a_sampled_maximum_by_a_parabola():
    t = np.arange(0, 10, 0.5)
    found = taylor_green.peak(t, 3 - (t - 4.2) ** 2)
    assert (found.time, found.value) == (pytest.approx(4.2), pytest.approx(3.0))


def test_compare_waits_for_the_curve_to_turn_over():
    ref = taylor_green.load_reference()
    rising = ref[ref[:, 0] <= 8.5]
    assert taylor_green.compare(rising[:, 0], rising[:, 2]) is None
    found = taylor_green.compare(ref[:, 0], 1.1 * ref[:, 2])
    assert found["peak_error"] == pytest.approx(0.1) and found["peak_time_error"] == pytest.approx(0, abs=1e-12)
