"""The estimator's memos (issue 54: a stage's memory kept as two halves, the model state's and the activations', and
each pipeline stage's activations and step-time terms by its layer kinds): an estimator that predicted a whole space
predicts each layout exactly as a fresh estimator that sees only that layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from sweeper.config.load import load_config
from sweeper.estimate import Estimator
from sweeper.estimate.calibration import Calibration
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
        fresh = Estimator.new_for_config(cfg)(lo)
        assert estimate == fresh, lo.short()  # breakdown, band, step terms: every figure, exactly
        assert shared.terms(lo)[2] == Estimator.new_for_config(cfg).terms(lo)[2], lo.short()


def test_the_estimators_of_one_config_share_their_memos_and_predict_as_fresh_ones() -> None:
    """``Estimator.for_config`` keeps one estimator per config object (issue 54: a plan, its production layouts'
    step times and a sweep's calibrations price the same stages): asked again, under another calibration or none,
    it predicts every layout exactly as an estimator made afresh for that calibration; ``step_time_s`` (the step
    without the memory verdict) is the full prediction's step."""
    cfg = load_config(SPACES[1])  # MoE with offloaded layers, their copies exposed over a slow host link: the step
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"host_link_gbs": 0.01})})  # then reads
    checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length, cfg.run)  # the activations' hot-rank factor
    valid = [lo for lo in enumerate_layouts(cfg) if not checker(lo)][::7]
    first = Estimator.for_config(cfg)
    assert Estimator.for_config(cfg) is first
    calibration = Calibration(activation_factor=1.2, state_factor=0.9, overhead_gib=0.5, step_time_factor=1.3)
    calibrated = Estimator.for_config(cfg, calibration)
    assert calibrated is not first and calibrated.memos()[1] is first.memos()[1]  # the links, blocks... shared
    assert Estimator.for_config(cfg.model_copy()) is not first  # another config object: its own
    hot = Calibration(activation_factor=1.1, moe_hot_rank_factor=2.5)  # sizes the activations: offload's bytes
    pairs = [(first, Estimator.new_for_config(cfg)), (calibrated, Estimator.new_for_config(cfg, calibration)),
             (Estimator.for_config(cfg, hot), Estimator.new_for_config(cfg, hot))]
    assert any(lo.offload_layers for lo in valid) and cfg.model.is_moe
    for lo in valid:
        for shared, fresh in pairs:
            want = fresh(lo)
            assert shared(lo) == want, lo.short()
            assert shared.step_terms(lo) == want.step_terms, lo.short()
            assert shared.step_time_s(lo) == want.step_time_s, lo.short()
