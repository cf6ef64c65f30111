"""The equivalence gate's tolerances are measured (issue 44): each sits at GATE_MARGIN x the worst known-correct layout
in tests/data/gate_error.json (scripts/measure_gate_error.py), and below what a wrong layout measures. A new
measurement that moves a worst case above its tolerance / GATE_MARGIN fails here until the tolerance follows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sweeper.backends.megatron.equivalence import GATE_MARGIN, TOLERANCE

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" / "gate_error.json").read_text())
ROWS = DATA["rows"]


def _worst_correct(precision: str) -> float:
    """The largest gate error of a correct layout (no injected fault) of ``precision`` against the FP32 reference;
    rows measured before the reference fit stopped at FIT_LOSS_FLOOR ("before") are the record of that fault."""
    return max(r["rel_err"] for r in ROWS if r["precision"] == precision and r["reference"] == "fp32"
               and r["inject"] is None and "before" not in r)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_each_measured_tolerance_is_the_margin_over_the_worst_correct_layout(precision: str) -> None:
    worst = _worst_correct(precision)
    assert worst * GATE_MARGIN <= TOLERANCE[precision]
    if precision == "bf16":  # set from the measurement, not above it: within a tenth of 2 x worst
        assert TOLERANCE[precision] <= 1.1 * GATE_MARGIN * worst
    correct = [r for r in ROWS if r["precision"] == precision and r["inject"] is None and "before" not in r]
    assert correct and all(r["status"] == "passed" for r in correct)


def test_a_wrong_layout_measures_far_above_every_tolerance() -> None:
    wrong = [r for r in ROWS if r["inject"] == "swap_shards"]
    assert {r["precision"] for r in wrong} >= {"fp32", "bf16"}
    for r in wrong:
        assert r["status"] == "failed" and r["failure_kind"] == "equivalence"
        assert r["rel_err"] > 10 * max(TOLERANCE.values())


def test_the_measurement_covers_both_flagship_proxies_and_the_sixteen_rank_layout() -> None:
    models = {r["model"] for r in ROWS}
    assert {"tiny-gpt", "tiny-moe", "nemotron", "deepseek", "tiny-5d"} <= models
