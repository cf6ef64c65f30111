"""``rounded``: Python's ``round`` over a numpy array, value for value, the ties and near-ties numpy's scaling gets
wrong among them (a plan's JSON rounds every figure through it, issue 54)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sweeper.estimate.rounding import rounded


def _values() -> np.ndarray:
    rng = np.random.default_rng(54)
    near_ties = [(k + 0.5) / 10**d for d in (1, 3, 4, 6) for k in range(0, 20000, 7)]
    return np.concatenate([
        rng.uniform(-1000, 1000, 50_000), rng.lognormal(0, 6, 50_000), np.array(near_ties),
        np.nextafter(np.array(near_ties), np.inf), np.nextafter(np.array(near_ties), -np.inf),
        np.array([0.0005, 2.675, 1.0005, 0.5, 1.5, 2.5, -0.5, -2.5, -0.0, 0.0, -0.0004, 1e300, -1e300, math.inf,
                  -math.inf, 5e-324, 2.0**52 + 1, 123456789.12345]),
    ])


@pytest.mark.parametrize("digits", [0, 1, 3, 4, 6])
def test_rounded_is_pythons_round_bit_for_bit(digits: int) -> None:
    values = _values()
    want = [round(v, digits) for v in values.tolist()]
    got = rounded(values, digits)
    assert [repr(x) for x in got] == [repr(x) for x in want]  # repr: -0.0 and 0.0 apart


def test_numpys_own_round_differs_where_rounded_does_not() -> None:
    values = np.array([0.0005, 1.0005, 2.675])
    assert np.round(values, 3).tolist() != [round(v, 3) for v in values.tolist()]  # what the module is for
    assert rounded(values, 3) == [round(v, 3) for v in values.tolist()]


def test_nan_is_a_figure_not_there() -> None:
    assert rounded(np.array([math.nan, 1.25]), 1) == [None, 1.2]
