"""Selection: a confirmation run confirms a layout only if it passed and its step time stayed steady.

The records below are selection test data (not trial results): a GPU run whose steps slow down, and one that does
not."""

from __future__ import annotations

from pathlib import Path

import yaml

from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.record.schema import TrialChecks, TrialMetrics, TrialRecord, TrialResult
from sweeper.search.decide.best_layout import best_layout_document
from sweeper.search.decide.candidates import candidates, choose
from sweeper.search.decide.decision import decision
from sweeper.search.decide.verdicts import step_time_drift

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path) -> SweepConfig:
    space = yaml.safe_load((ROOT / "search_spaces" / "quickstart.yaml").read_text())
    space["training"] = {**space["training"], "warmup_steps": 2}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    return load_config(path)


def _result(times: list[float], tokens: float) -> TrialResult:
    return TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=tokens, step_time_s=1.0,
                                                             peak_memory_gib=1.0),
                       checks=TrialChecks(True, True, True, True, True, True), backend="megatron-core-gpu",
                       memory_kind="device", step_times_s=times)


def test_step_time_drift_is_the_last_quarter_over_the_first_after_warmup() -> None:
    steady = [5.0, 3.0] + [1.0] * 12
    assert step_time_drift(_result(steady, 1.0), 2) == 1.0
    slowing = [5.0, 3.0] + [1.0] * 3 + [1.2] * 6 + [2.0] * 3
    assert step_time_drift(_result(slowing, 1.0), 2) == 2.0
    assert step_time_drift(_result([1.0] * 8, 1.0), 2) is None  # 6 timed steps: too few


def test_a_confirmation_whose_steps_slow_down_does_not_confirm(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    fast, slow = (layout_from_string(cfg, text) for text in ("gpus=2,pp=2,mbs=2", "gpus=4,ep=4,mbs=2"))
    records = [
        TrialRecord(1, fast.to_dict(), _result([1.0] * 6, 900.0)),
        TrialRecord(1, fast.to_dict(), _result([1.0] * 4 + [1.0] * 3 + [1.2] * 3 + [2.5] * 3, 880.0),
                    phase="confirm"),
        TrialRecord(2, slow.to_dict(), _result([1.0] * 6, 700.0)),
        TrialRecord(2, slow.to_dict(), _result([1.0] * 14, 690.0), phase="confirm"),
    ]
    cands = candidates(records, cfg)
    assert [c.number for c in cands] == [1, 2] and not cands[0].confirmed(cfg) and cands[1].confirmed(cfg)
    winner = choose(cands, cfg)
    assert winner is not None and winner.number == 2
    doc = best_layout_document(cfg, winner, None)
    assert doc["confirmation"]["step_time_drift"] == [1.0] and doc["confirmation"]["max_step_time_drift"] == 1.5
    # On the CPU backend cores are shared between trials: the drift is not held against the layout.
    records[1].result.memory_kind = "host"
    assert candidates(records, cfg)[0].confirmed(cfg)


def test_best_layout_names_the_layouts_the_reference_checkpoint_moved_into(tmp_path: Path) -> None:
    # Selection test data (not trials): two stable layouts loaded the reference (equivalence checked), one did not.
    cfg = _cfg(tmp_path)
    a, b, c = (layout_from_string(cfg, text) for text in ("gpus=2,pp=2,mbs=2", "gpus=4,ep=4,mbs=2", "gpus=2,mbs=1"))
    loaded = {"from_layout": "TP1-PP1-DP1-MBS1-fp32", "tensors": 20, "resharded": ["x"], "load_s": [0.1, 0.1]}
    results = [_result([1.0] * 6, 900.0), _result([1.0] * 6, 800.0), _result([1.0] * 6, 700.0)]
    for result in results[:2]:
        result.checks.equivalence_rel_err, result.reference_load = 1e-6, loaded
    records = [TrialRecord(n, lo.to_dict(), r) for n, (lo, r) in enumerate(zip((a, b, c), results), start=1)]
    cands = candidates(records, cfg)
    doc = best_layout_document(cfg, cands[0], None, cands)
    moves = doc["checkpoint_moves_to"]
    assert moves["layouts"] == [a.short(), b.short()] and moves["written_by"] == ["TP1-PP1-DP1-MBS1-fp32"]
    assert "sweeper migrate" in moves["note"]


def test_a_confirmation_over_the_headroom_under_routing_stress_is_not_stable(tmp_path: Path) -> None:
    # Selection test data (not trials): the quickstart's 4 GiB GPUs at 10% headroom allow 3.6 GiB.
    from sweeper.search.decide.verdicts import is_stable

    cfg = _cfg(tmp_path)
    result = _result([1.0] * 6, 900.0)
    assert is_stable(result, cfg)
    result.metrics.stress_peak_memory_gib = 3.5
    assert is_stable(result, cfg)
    result.metrics.stress_peak_memory_gib = 3.7
    assert not is_stable(result, cfg)


def test_a_gpu_peak_counts_the_memory_outside_torchs_allocator(tmp_path: Path) -> None:
    """Issue 30: the allocator's reserved peak is not all a GPU holds; the context and NCCL buffers measured
    beside it count against the headroom too (the estimator adds the same). Selection test data (not trials)."""
    from sweeper.search.decide.verdicts import is_stable

    cfg = _cfg(tmp_path)  # 3.6 GiB allowed
    result = _result([1.0] * 6, 900.0)
    result.metrics.peak_memory_gib = 3.0
    assert is_stable(result, cfg)
    result.metrics.non_torch_memory_gib = 0.7
    assert not is_stable(result, cfg)
    result.metrics.non_torch_memory_gib, result.metrics.stress_peak_memory_gib = 0.5, 3.2
    assert not is_stable(result, cfg)


def test_a_run_at_scale_is_the_figure_and_a_failure_at_scale_does_not_win(tmp_path: Path) -> None:
    # Selection test data (not trials), issue 53: on the quickstart's 4 GPUs (N), a 2-GPU winner ran as the
    # production run itself (2 copies as one 4-GPU run, the production batch): that measurement, not the 2-GPU
    # runs' projection, is its figure; a layout whose run at scale failed is not confirmed.
    cfg = _cfg(tmp_path)
    small, other = (layout_from_string(cfg, text) for text in ("gpus=2,pp=2,mbs=2", "gpus=2,ep=2,mbs=2"))
    (at_scale,) = cfg.at_scale_layouts(small)
    assert at_scale.world_size == 4 and at_scale.dp == 2 * small.dp and at_scale.gbs == 2 * small.gbs
    assert at_scale == cfg.production_layout(small)

    def result(tokens: float, passed: bool = True) -> TrialResult:
        made = _result([1.0] * 14, tokens)
        if not passed:
            made.status, made.failure_kind, made.error = "failed", "crash", "a rank died (test data)"
        return made

    records = [
        TrialRecord(1, small.to_dict(), _result([1.0] * 6, 900.0)),
        TrialRecord(1, small.to_dict(), result(880.0), phase="confirm"),
        TrialRecord(2, other.to_dict(), _result([1.0] * 6, 850.0)),
        TrialRecord(2, other.to_dict(), result(840.0), phase="confirm"),
        TrialRecord(1, at_scale.to_dict(), result(1500.0), phase="confirm", attempt=2),
    ]
    cands = {c.number: c for c in candidates(records, cfg)}
    first = cands[1]
    assert first.at_scale is records[4] and first.trial_runs == records[:2]
    assert first.figure(cfg) == 1500.0  # measured on the production run's 4 GPUs: nothing projected
    # its 2-GPU runs (900 and 880), each doubled and slowed by the larger data parallelism the estimator prices
    assert 0.95 * 1780.0 < first.median(cfg) < 1780.0  # the mean of an even count's middle two
    winner = choose(list(cands.values()), cfg)
    assert winner is not None and winner.number == 2  # 2 x 840 projected beats the 1,500 measured at scale
    doc = best_layout_document(cfg, first, None)
    assert doc["objective"]["figure"] == 1500.0 and doc["objective"]["measured_on_gpus"] == 4
    assert doc["objective"]["at_scale"]["gpus"] == 4 and doc["measured_run"] == {"phase": "confirm", "attempt": 2}
    assert doc["objective"]["projected_share"] == 0.0
    made = decision(cfg, list(cands.values()), first, records)
    assert made is not None
    entry = made["layouts"][0]
    assert entry["production"]["basis"] == "measured on the production run's 4 GPUs"
    assert entry["production"]["projected_share"] == 0.0 and entry["production"]["tokens_per_s"] == 1500.0
    # one run at scale: banded by the spread its 2-GPU runs showed around their median (880 and 900)
    assert entry["production"]["low"] == 1500.0 * 880 / 890 and entry["production"]["high"] == 1500.0 * 900 / 890
    # A failure at scale (the layout's) un-confirms it, whatever its trial-size runs measured.
    records[4] = TrialRecord(1, at_scale.to_dict(), result(0.0, passed=False), phase="confirm", attempt=2)
    first = next(c for c in candidates(records, cfg) if c.number == 1)
    assert not first.confirmed(cfg) and first.at_scale is None and first.figure(cfg) == first.median(cfg)
