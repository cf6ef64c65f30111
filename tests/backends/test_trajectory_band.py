"""The confirmation's trajectory bands (``verdicts.TRAJECTORY_BAND``) are what was measured: TRAJECTORY_MARGIN x
the worst layout that passed every check in tests/data/trajectory_band.json (scripts/measure_trajectory_band.py),
rounded up to one significant figure, and the measurement covers the layouts it claims."""

from __future__ import annotations

import json
import math
from pathlib import Path

from sweeper.search.decide.verdicts import TRAJECTORY_BAND, TRAJECTORY_MARGIN

MEASURED = json.loads((Path(__file__).parents[1] / "data" / "trajectory_band.json").read_text())


def _worst(precision: str) -> float:
    return max(row["max_rel_err"] for model in MEASURED["models"].values()
               for row in model[precision]["layouts"].values() if not row.get("failed"))


def test_each_band_is_the_margin_over_the_worst_correct_layout_rounded_up() -> None:
    for precision, band in TRAJECTORY_BAND.items():
        wanted = TRAJECTORY_MARGIN * _worst(precision)
        exponent = math.floor(math.log10(wanted))
        rounded_up = math.ceil(wanted / 10 ** exponent) * 10 ** exponent
        assert math.isclose(band, rounded_up, rel_tol=1e-9), (precision, band, wanted)
        assert MEASURED["worst_max_rel_err"][precision] == _worst(precision)


def test_the_measurement_ran_every_axis_on_both_models_for_a_confirmations_steps() -> None:
    assert set(MEASURED["models"]) == {"tiny-gpt", "tiny-moe"} and MEASURED["steps"] >= 12
    for model in MEASURED["models"].values():
        for precision in TRAJECTORY_BAND:
            rows = model[precision]["layouts"]
            assert {"tp2-sp", "pp2", "dp2"} <= set(rows)
            assert all(len(row["per_step"]) == MEASURED["steps"] for row in rows.values())
