"""The refit step-time model's turns in choosing layouts.

Each passed trial's measured step time refits one efficiency factor per step-time term (``estimate.step_fit``, kept
by the sweep's ``Calibrator``), on the backend the trials ran on: a simulated cluster's CPU ranks or the GPUs. Once
``FIRST_TURN`` trials are measured, every proposal is the refit model's best untried launchable layout, queued in
the study ahead of TPE's next draw; the trials before it are TPE's opening (on GPUs, the estimator's favourites).
Each layout the model got wrong is measured and corrects it, so the walk down its ranking re-ranks as it goes.
``benchmarks/search_efficiency.py`` measures this (``tpe+refit``) against TPE alone and random on the recorded
landscapes; giving TPE every third or fourth proposal instead, or the model's first turn after three trials, took
more trials on all three. Choosing by expected improvement with the fit's uncertainty instead (``"ei"``) tied with
greedy (20 seeds each, the same median on all five landscapes: 5, 6, 5 on the measured ones, 2 and 2 on rehearsed
Nemotron and DeepSeek-V3 ones; EI fewer trials on 20 seeds of 100, more on 8; ``benchmarks/proposer_comparison.py``,
docs/benchmarks.md): the turn stays greedy.
"""

from __future__ import annotations

import math
import weakref
from typing import Literal

from sweeper.config.schema import SweepConfig
from sweeper.estimate.step_fit import StepModel
from sweeper.search.decide.objective import copies, production_rate, production_terms
from sweeper.space.layout import Layout

# Measured trials before the model proposes: one fixes its level only, two let it free a term.
FIRST_TURN = 2
# How the model chooses: "greedy", its best predicted untried layout; "ei", the largest expected improvement over
# the best measured layout given what the fit leaves unknown (``expected_improvement``).
Acquisition = Literal["greedy", "ei"]
ACQUISITION: Acquisition = "greedy"


def predicted_objective(model: StepModel, layout: Layout, cfg: SweepConfig) -> float:
    """The sweep's objective as the refit model predicts it (``search.objective``): the trial's step time as the model
    ranks it (``StepModel.ranking_step_s``: by the freed terms' factors once they have predicted measured trials better
    than the level alone, until then by the estimator's shape at that level), projected to the production run the way a
    measured trial's is (``objective.projected``), so that a proposal is ranked on the same scale as the measured
    layouts it must beat. (Predicting the production layout's step instead priced it on a simulated cluster as N ranks
    sharing the host's cores: every layout smaller than N looked that many times slower than its measured projection,
    and the quickstart's refit took 10 trials to the best instead of 5.) The production run's extra step
    (``objective.extra_step_s``: the estimator's terms of the production layout less the trial's) is priced with what
    the refit learnt of those terms since its start (``StepModel.refit_seconds``): as the objective prices it before a
    trial is measured, so that the first order is the estimator's, and a fit of the level alone, which scales every
    layout's step alike, scales the extra step alike and keeps that order (issue 54: left at the estimator's price, a
    level of 300 on the CPU landscapes made the extra step a 300th of what the prior weighed it at, and the dense GPT's
    order changed after one trial). 0.0 where the production run holds no copy of the layout (``production_rate``)."""
    held = _OBJECTIVES.get(model)
    if held is None or held[0] is not model.fit or held[1] is not cfg:  # a new sample refitted it: all anew
        held = _OBJECTIVES[model] = (model.fit, cfg, {})
    kept = held[2].get(layout)
    if kept is None:
        kept = held[2][layout] = _predicted_objective(model, layout, cfg)
    return kept


# Per step model: its fit and the config the objectives below were ranked for, and each layout's (a ranked proposal
# asks for every untried layout on every turn; the model changes only with a new sample, which makes a new fit).
_OBJECTIVES: weakref.WeakKeyDictionary[StepModel, tuple[object, SweepConfig, dict[Layout, float]]] = (
    weakref.WeakKeyDictionary())


def _predicted_objective(model: StepModel, layout: Layout, cfg: SweepConfig) -> float:
    step = model.ranking_step_s(layout)
    if step <= 0 or not copies(cfg, layout):
        return 0.0
    per_gpu = cfg.search.objective == "tflops_per_gpu"  # as objective.projected: per GPU is in proportion
    tokens_per_s = layout.gbs * cfg.training.seq_length / step
    rate = tokens_per_s / layout.world_size if per_gpu else tokens_per_s
    side_by_side = production_rate(cfg, layout, rate, None, per_gpu=per_gpu)  # the copies, no extra step yet
    return side_by_side * step / (step + _extra_step_s(model, cfg, layout))


def _extra_step_s(model: StepModel, cfg: SweepConfig, layout: Layout) -> float:
    """The production run's step over the trial's (``objective.extra_step_s``), each of its terms priced with what
    the model's refit changed of that term's factor (``StepModel.refit_seconds``)."""
    terms = production_terms(cfg, layout)  # the sweep's estimator, uncalibrated: the production run is GPUs
    if terms is None:
        return 0.0
    return max(0.0, model.refit_seconds(terms[1]) - model.refit_seconds(terms[0]))


def expected_improvement(model: StepModel, layout: Layout, cfg: SweepConfig, incumbent: float) -> float:
    """The expected gain in log objective over ``incumbent`` (the best measured layout's, as the model predicts it)
    if ``layout`` ran: its log objective is normal, the model's prediction as mean and the fit's standard deviation
    of the layout's log step time (``StepModel.log_sd``) as spread; ``s (z Phi(z) + phi(z))`` with
    ``z = (mean - incumbent) / s``. A layout the model knows well is worth its predicted gain; one it knows little
    about is worth a chance of a large one."""
    objective = predicted_objective(model, layout, cfg)
    if objective <= 0:  # no production run holds the layout
        return 0.0
    gain = math.log(objective) - incumbent
    sd = model.log_sd(layout)
    if sd <= 0:
        return max(0.0, gain)
    z = gain / sd
    return sd * (z * 0.5 * (1 + math.erf(z / math.sqrt(2))) + math.exp(-z * z / 2) / math.sqrt(2 * math.pi))


def turn(model: StepModel, cfg: SweepConfig, untried: list[Layout],
         acquisition: Acquisition = ACQUISITION) -> Layout | None:
    """The refit model's proposal among ``untried`` launchable layouts, or None while it has too few samples."""
    if len(model.samples) < FIRST_TURN or not untried:
        return None
    if acquisition == "greedy":
        return max(untried, key=lambda lo: predicted_objective(model, lo, cfg))
    measured = max(predicted_objective(model, lo, cfg) for lo in set(model.layouts))
    if measured <= 0:  # no measured layout has a production run to improve on: the best prediction is the gain
        return max(untried, key=lambda lo: predicted_objective(model, lo, cfg))
    return max(untried, key=lambda lo: expected_improvement(model, lo, cfg, math.log(measured)))
