"""The Fréchet distance against a float64 SciPy reference, and the evaluation's reference points."""

import numpy as np
import pytest
import scipy.linalg

from systolic.workloads.gan.evaluate import frechet_distance


def scipy_frechet(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = scipy.linalg.sqrtm(cov_a @ cov_b)
    return float(((a.mean(0) - b.mean(0)) ** 2).sum() + np.trace(cov_a + cov_b - 2 * np.real(root)))


@pytest.mark.parametrize("dim,shift", [(8, 0.0), (64, 0.5), (16, 3.0)])
def test_frechet_matches_scipy_reference(dim, shift):
    rng = np.random.default_rng(dim)
    a = rng.normal(size=(500, dim)) @ rng.normal(size=(dim, dim))
    b = rng.normal(size=(400, dim)) * 1.5 + shift
    expected = scipy_frechet(a, b)
    assert expected > 0
    np.testing.assert_allclose(frechet_distance(a.astype(np.float32), b.astype(np.float32)), expected, rtol=1e-6)


def test_frechet_of_a_set_with_itself_is_zero():
    a = np.random.default_rng(0).normal(size=(300, 16))
    assert abs(frechet_distance(a, a)) < 1e-8
