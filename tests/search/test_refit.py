"""The refit model's turns (search.propose.refit): greedy and expected improvement over the best measured layout."""

from __future__ import annotations

import math
from pathlib import Path

from sweeper.config.load import load_config
from sweeper.estimate import Estimator
from sweeper.estimate.step_fit import StepModel
from sweeper.plan.assess import assess_all
from sweeper.plan.space import enumerate_layouts
from sweeper.search.propose.refit import expected_improvement, predicted_objective, turn

ROOT = Path(__file__).resolve().parents[2]


def test_expected_improvement_is_at_least_the_predicted_gain_and_proposes_an_untried_layout() -> None:
    """Issue 46: a normal's expected gain over the incumbent is at least its mean's gain, and never below zero;
    both turns wait for two samples and propose an untried layout, greedy the best predicted one."""
    cfg = load_config(ROOT / "search_spaces" / "quickstart.yaml")
    model = StepModel(Estimator.for_config(cfg))
    launchable = [e.layout for e in assess_all(cfg, enumerate_layouts(cfg)) if e.launchable]
    first, second, *untried = launchable
    model.add(first, 1.5 * model.step_time_s(first))
    assert turn(model, cfg, untried, "ei") is None and turn(model, cfg, untried, "greedy") is None
    model.add(second, 3.0 * model.step_time_s(second))
    incumbent = math.log(max(predicted_objective(model, lo, cfg) for lo in (first, second)))
    for layout in untried:
        gain = math.log(predicted_objective(model, layout, cfg)) - incumbent
        assert expected_improvement(model, layout, cfg, incumbent) >= max(0.0, gain) - 1e-12
    assert turn(model, cfg, untried, "ei") in untried
    assert turn(model, cfg, untried, "greedy") == max(untried, key=lambda lo: predicted_objective(model, lo, cfg))


def test_the_refit_prices_a_proposal_as_a_trial_measuring_its_prediction_would_be_projected() -> None:
    """Issue 46, found by benchmarks/search_efficiency.py (the quickstart's refit took 10 trials to the best where it
    took 5): the refit model's objective for a layout is the one a trial measuring exactly the model's predicted step
    would get (``objective_value``), on a simulated cluster too, where the model prices ranks sharing the host's
    cores. Predicting the production layout instead priced a 2-GPU layout's production run as 4 ranks on 2 cores."""
    from sweeper.record.schema import TrialMetrics, TrialResult
    from sweeper.search.decide.objective import copies, objective_value

    cfg = load_config(ROOT / "search_spaces" / "quickstart.yaml")
    model = StepModel(Estimator.for_config(cfg, host_cores=2))
    launchable = [e.layout for e in assess_all(cfg, enumerate_layouts(cfg)) if e.launchable]
    assert {copies(cfg, lo) for lo in launchable} == {1, 2}  # 2- and 4-GPU layouts on the 4-GPU cluster
    for layout in launchable:
        step = model.step_time_s(layout)
        measured = TrialResult(status="passed", metrics=TrialMetrics(
            step_time_s=step, tokens_per_s=layout.gbs * cfg.training.seq_length / step))
        assert math.isclose(predicted_objective(model, layout, cfg), objective_value(measured, cfg, layout),
                            rel_tol=1e-9), layout.short()
