"""Python's ``round(x, digits)`` over a numpy array, value for value: a plan rounds every figure of 53,739
predictions for its JSON (issue 54), and Python's ``round`` one float at a time was a third of that.

Python rounds the float's exact value to ``digits`` decimals (ties to even) and returns the float nearest that
decimal. ``np.round`` scales by ``10**digits`` first, and that product's own rounding can carry a value lying within
an ulp of a half to the other side of it (``round(0.0005, 3)`` is 0.001, ``np.round(0.0005, 3)`` 0.0). Away from a
half the scaled value rounds to the same integer R as the exact one, and ``R / 10**digits`` (an exact integer over
an exact power of ten, one correctly rounded division) is the float nearest R x 10**-digits, as Python's is: only
the values near a half, beyond 2**52 or not finite go through Python's ``round``.
"""

from __future__ import annotations

import numpy as np

_EXACT = 2.0**52  # beyond it a float has no fraction to round


def rounded(values: np.ndarray, digits: int) -> list[float | None]:
    """``[round(v, digits) for v in values.tolist()]`` (float64 ``values``, ``0 <= digits <= 15``); NaN, which no
    figure of an Estimate is, gives None: a figure it has not got."""
    scale = 10.0**digits
    scaled = values * scale
    out: list[float | None] = (np.rint(scaled) / scale).tolist()
    magnitude = np.abs(scaled)
    with np.errstate(invalid="ignore"):
        near_half = np.abs(np.abs(scaled - np.trunc(scaled)) - 0.5) <= np.spacing(magnitude)
        python = near_half | ~(magnitude < _EXACT)  # NaN and infinities compare False
    for i in np.flatnonzero(python).tolist():
        value = float(values[i])
        out[i] = None if value != value else round(value, digits)
    return out
