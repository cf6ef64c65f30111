"""The estimator's memos (issue 54: a stage's memory kept as two halves, the model state's and the activations', and
each pipeline stage's activations and step-time terms by its layer kinds): an estimator that predicted a whole space
predicts each layout exactly as a fresh estimator that sees only that layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from sweeper.config.load import load_config
from sweeper.estimate import Estimator
from sweeper.plan.rules import Checker
from sweeper.plan.space import enumerate_layouts

ROOT = Path(__file__).resolve().parents[2]
SPACES = [
    ROOT / "benchmarks" / "spaces" / "nemotron_wide.yaml",  # MoE + Mamba, uneven splits, VPP
    ROOT / "search_spaces" / "moe_knobs.yaml",  # A2A overlap and offload: the activations' other keys
    ROOT / "search_spaces" / "deepseek_v3_1024_vendor.yaml",  # MTP layers, layout strings
]


@pytest.mark.parametrize("space", SPACES, ids=lambda p: p.stem)
def test_a_shared_estimator_predicts_each_layout_as_a_fresh_one(space: Path) -> None:
    cfg = load_config(space)
    checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length, cfg.run)
    valid = [lo for lo in enumerate_layouts(cfg) if not checker(lo)]
    shared = Estimator.for_config(cfg)
    predicted = [shared(lo) for lo in valid]  # every memo filled by the layouts before
    step = max(1, len(valid) // 150)  # a fresh estimator per layout: a sample of the large space
    for lo, estimate in list(zip(valid, predicted))[::step]:
        fresh = Estimator.for_config(cfg)(lo)
        assert estimate == fresh, lo.short()  # breakdown, band, step terms: every figure, exactly
        assert shared.terms(lo)[2] == Estimator.for_config(cfg).terms(lo)[2], lo.short()
