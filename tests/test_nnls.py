"""The exact small non-negative least squares that replaced scipy's ``nnls`` (planner/terapipe.py)."""
from __future__ import annotations

import numpy as np
import pytest

from ptplan.planner.terapipe import _nnls


def _kkt_gap(A: np.ndarray, y: np.ndarray, x: np.ndarray) -> float:
    """How far x is from NNLS optimality: x >= 0, gradient >= 0, and gradient = 0 where x > 0."""
    g = A.T @ (A @ x - y)
    scale = max(float(np.abs(A.T @ y).max()), 1e-12)
    return max(float(-x.min()), float(-g.min()) / scale, float(np.abs(g[x > 1e-12]).max(initial=0.0)) / scale)


@pytest.mark.parametrize("seed", range(40))
def test_nnls_meets_the_optimality_conditions(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    A = rng.normal(size=(int(rng.integers(n, 14)), n))
    y = rng.normal(size=A.shape[0])
    x = _nnls(A, y)
    assert _kkt_gap(A, y, x) < 1e-9
    free, *_ = np.linalg.lstsq(A, y, rcond=None)
    if (free >= 0).all():  # the unconstrained optimum is feasible: NNLS must return it
        np.testing.assert_allclose(x, free, rtol=1e-9, atol=1e-12)


def test_nnls_clamps_a_negative_coefficient_to_zero():
    A = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = np.array([2.0, -1.0, 1.0])  # unconstrained: x = (2, -1); with x2 >= 0: x = (1.5, 0)
    np.testing.assert_allclose(_nnls(A, y), [1.5, 0.0], atol=1e-12)
