"""The decision section (issue 18): projected time and cost of the budget, the throughput's basis and band, and why.

The trial records below are test data for the decision's arithmetic (not trial results): a GPU sweep whose
winner measured 900 and 1000 tokens/s, a runner-up, and a faster layout the sweep pruned; then the same layouts
measured on the CPU backend, where the basis must become the estimator's prediction for the configured GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.estimate import estimate
from sweeper.estimate.calibration import Calibration
from sweeper.record.schema import SweepMeta, TrialChecks, TrialMetrics, TrialRecord, TrialResult
from sweeper.report.render import decision_section
from sweeper.search.decide.candidates import candidates, choose
from sweeper.search.decide.decision import decision, summary_line
from sweeper.search.decide.objective import PROJECTED_STEP_ERROR, extra_step_s

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, budget: str | None = "{tokens: 1e9, gpu_hour_usd: 2.0, gpus: 8}") -> SweepConfig:
    text = (ROOT / "search_spaces" / "quickstart.yaml").read_text()
    if budget:
        text += f"budget: {budget}\n"
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return load_config(path)


def _passed(tokens: float, kind: str = "device", peak: float = 1.0) -> TrialResult:
    return TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=tokens, step_time_s=1.0,
                                                             peak_memory_gib=peak),
                       checks=TrialChecks(True, True, True, True, True, True), memory_kind=kind,  # type: ignore[arg-type]
                       backend="megatron-core-gpu" if kind == "device" else "megatron-core-cpu",
                       step_times_s=[1.0] * 6)


def _records(cfg: SweepConfig, kind: str) -> list[TrialRecord]:
    win, runner, pruned = (layout_from_string(cfg, t) for t in
                           ("gpus=4,ep=4,mbs=2", "gpus=4,tp=2,ep=2,mbs=1", "gpus=4,ep=2,mbs=2"))

    def predicted(layout, tokens=None):  # type: ignore[no-untyped-def]
        e = estimate(cfg.model, layout, cfg.cluster, cfg.training.seq_length, cfg.estimate, run=cfg.run).to_json()
        return {**e, "tokens_per_s": tokens or e["tokens_per_s"]}

    return [
        TrialRecord(1, win.to_dict(), _passed(1000.0, kind), predicted=predicted(win, 5000.0)),
        TrialRecord(1, win.to_dict(), _passed(900.0, kind), phase="confirm", predicted=predicted(win, 5000.0)),
        TrialRecord(2, runner.to_dict(), _passed(500.0, kind), predicted=predicted(runner, 4000.0)),
        TrialRecord(3, pruned.to_dict(), TrialResult.pruned("predicted 9.9 GiB over the limit", kind="oom"),
                    attempt=0, predicted=predicted(pruned, 9000.0)),
    ]


def test_a_gpu_sweep_projects_the_budget_from_the_measured_runs(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    records = _records(cfg, "device")
    cands = candidates(records, cfg)
    winner = choose(cands, cfg)
    assert winner is not None and winner.number == 1
    block = decision(cfg, cands, winner, records)
    assert block is not None and block["budget"] == {"tokens": 1e9, "gpu_hour_usd": 2.0, "gpus": 8}
    first, second = block["layouts"]
    assert [first["role"], second["role"]] == ["winner", "runner-up"]
    assert first["tokens_per_s"] == {"basis": "measured", "median": 950.0, "low": 900.0, "high": 1000.0, "runs": 2,
                                     "step_time_s": 1.0, "on_gpus": 4}
    # 8 GPUs hold two copies of the 4-GPU layout: 1900 tokens/s, less the estimator's extra step at DP 8 (the tiny
    # model's reduce: a few microseconds against the measured 1 s step).
    proj = first["projection"]
    assert proj["copies"] == 2 and proj["gpus"] == 8
    assert first["production"]["tokens_per_s"] == pytest.approx(1900.0, rel=1e-3) and \
        first["production"]["tokens_per_s"] < 1900.0
    assert first["production"]["tokens_per_s"] > second["production"]["tokens_per_s"]
    seconds = 1e9 / first["production"]["tokens_per_s"]
    assert proj["days"] == pytest.approx(seconds / 86400)
    assert proj["gpu_hours"] == pytest.approx(8 * seconds / 3600)
    assert proj["cost_usd"] == pytest.approx(2.0 * 8 * seconds / 3600)
    assert proj["days_slow"] == pytest.approx(1e9 / 1800.0 / 86400, rel=1e-3)  # at the slowest run
    assert proj["days_fast"] == pytest.approx(1e9 / 2000.0 / 86400, rel=1e-3)
    # Compared on the production run, as the choice compares them (both 4-GPU layouts: two copies each).
    assert second["relative_to_first"] == second["production"]["tokens_per_s"] / first["production"]["tokens_per_s"]
    assert second["relative_to_first"] == pytest.approx(500.0 / 950.0, rel=1e-3)
    # Why: the pruned layout was predicted faster (9000 vs 5000) and differs in ep; the reason it was not launched.
    assert "ep 2 instead of 4" in first["why"] and "not launched: predicted 9.9 GiB over the limit" in first["why"]
    assert first["binding"] in ("memory", "step time") and set(first["memory_gib"]) >= {"weights", "activations"}
    # 6.09 days (5.79 at the fastest run, 6.43 at the slowest), 1,170 GPU-hours, $2,339
    assert summary_line(block) == ("budget 1e+09 tokens on 8 GPUs: 6.09 days (5.79-6.43), 1,170 GPU-hours, $2,339 "
                                   "(throughput measured on 4 GPUs, 0% of the step projected to 8 GPUs)")
    html = decision_section(SweepMeta(decision=block))
    assert "$" in html and "measured" in html and "1e+09 tokens" in html and first["why"][:40] in html


def test_a_cpu_sweep_projects_from_the_prediction_with_its_band(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, budget="{tokens: 1e9}")
    records = _records(cfg, "host")
    cands = candidates(records, cfg)
    winner = choose(cands, cfg, confirmed_only=False)
    block = decision(cfg, cands, winner, records)
    assert block is not None
    rate = block["layouts"][0]["tokens_per_s"]
    predicted = estimate(cfg.model, winner.layout, cfg.cluster, cfg.training.seq_length, cfg.estimate,  # type: ignore[union-attr]
                         run=cfg.run).tokens_per_s
    assert rate["basis"] == "predicted" and rate["median"] == pytest.approx(predicted)
    assert (rate["low"], rate["high"]) == pytest.approx((0.65 * predicted, 1.65 * predicted))
    proj = block["layouts"][0]["projection"]
    assert proj["gpus"] == 4 and proj["copies"] == 1 and "cost_usd" not in proj
    assert "Predicted throughput" in decision_section(SweepMeta(decision=block))


def test_without_a_budget_the_section_says_how_to_ask_for_one(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, budget=None)
    records = _records(cfg, "device")
    cands = candidates(records, cfg)
    block = decision(cfg, cands, choose(cands, cfg), records)
    assert block is not None and "projection" not in block["layouts"][0]
    assert "No <code>budget:</code>" in decision_section(SweepMeta(decision=block))
    assert decision(cfg, [], None, []) is None and summary_line(block) is None


def test_fewer_budget_gpus_than_the_layout_is_said_not_divided_by_zero(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, budget="{tokens: 1e9, gpus: 2}")
    records = _records(cfg, "device")
    cands = candidates(records, cfg)
    block = decision(cfg, cands, choose(cands, cfg), records)
    assert block is not None
    assert block["layouts"][0]["projection"] == {
        "gpus": 2, "copies": 0, "note": "the production run's 2 GPUs are fewer than the layout's 4 GPUs"}
    assert yaml.safe_dump(block)  # plain data, as sweep.json and MLflow take it


def test_the_decision_says_how_much_of_its_figure_is_projected_and_bands_it_with_the_estimators_error(
        tmp_path: Path) -> None:
    """Issue 53: the production figure was called measured, with the runs' band of a few percent, though part of its
    step was the estimator's. Its measured and projected parts are named, and the band holds the projected part's
    error."""
    cfg = _cfg(tmp_path)
    records = _records(cfg, "device")
    cands = candidates(records, cfg)
    # The sweep measured the data-parallel reduce far slower than the estimator's first guess.
    slow_reduce = Calibration(step_term_factors={"dp": 2e5}, samples=3)
    block = decision(cfg, cands, choose(cands, cfg), records, slow_reduce)
    assert block is not None
    made = block["layouts"][0]["production"]
    extra = extra_step_s(cfg, cands[0].layout, slow_reduce)
    assert made["measured_step_s"] == 1.0 and made["projected_step_s"] == extra > 0.05
    assert made["projected_share"] == pytest.approx(extra / (1.0 + extra))
    assert made["priced_by"] == "the calibrated estimator"
    assert made["basis"] == f"measured on 4 GPUs, {extra / (1 + extra):.0%} of the step projected to 8 GPUs"
    # The band: the slowest run with the projected part PROJECTED_STEP_ERROR slower, the fastest with it faster.
    assert made["low"] == pytest.approx(2 * 900.0 / (1.0 + extra * (1 + PROJECTED_STEP_ERROR)))
    assert made["high"] == pytest.approx(2 * 1000.0 / (1.0 + extra * (1 - PROJECTED_STEP_ERROR)))
    assert made["tokens_per_s"] == pytest.approx(2 * 950.0 / (1.0 + extra))
    html = decision_section(SweepMeta(decision=block))
    assert made["basis"] in html and "projected" in html and "scale linearly" not in html
