"""The default proposer (issue 54): the calibrated estimator's order, with a share of exploring turns where the fit is
unsure.

Every proposal is the untried launchable layout with the best objective as the sweep's step-time model predicts it
(``refit.predicted_objective``: the estimator's terms, refitted after every measured trial by ``estimate.step_fit``), so
before a trial is measured the order is the estimator's own (on GPUs: the frontier's), and each measured trial re-ranks
what is left: first by the level alone, which keeps the estimator's order (the production run's extra step scaled with
the step), then by the freed terms once they have predicted a measured trial better than the level alone did, or at once
where the level alone misses a measured trial beyond the prior's factor of three (``StepModel.refit_leads``; on the
dense GPT's CPU landscape a third trial freed the bubble to explain what BF16 costs there, and the order it gave took a
trial more than the estimator's on 8 seeds of 10). A share ``EXPLORATION`` of the turns may go instead to the untried
layout whose prediction the fit is least sure of (``StepModel.log_sd``: the Laplace spread of the level and every term's
factor; a term no measured trial has keeps its whole prior, so layouts made of terms nothing measured come first), among
those that could still beat the best predicted one at ``OPTIMISM`` standard deviations; where none could, or nothing is
measured yet (no spread), the turn keeps the order.

``benchmarks/default_proposer.py`` measures it against the estimator's order never refitted, the space's grid order and
TPE with the refit's turns (``sampler: tpe``, the default before) on the measured CPU landscapes and on rehearsed GPU
ones whose truth carries the estimator's held-out error (docs/benchmarks.md). Exploring every fourth turn took more
trials than not exploring on all four landscapes that finished (a trial more on each CPU landscape at the median, 1.5
more on rehearsed Nemotron), so the default explores none: the rehearsal draws each layout's
error on its own, which no measured neighbour can reveal, and on the CPU landscapes the fourth ordered turn already
finds the best. The exploring turn stays, tested, for a cluster whose errors follow the terms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sweeper.config.schema import SweepConfig
from sweeper.estimate.step_fit import StepModel
from sweeper.search.propose.refit import predicted_objective
from sweeper.space.layout import Layout

# The share of turns that explore: turn k (0-based) explores when floor((k + 1) * share) > floor(k * share). None by
# default (module docstring: 0.25 took more trials on all four landscapes).
EXPLORATION = 0.0
# How many of the fit's standard deviations a layout's log objective may lie above its prediction for it to be worth
# an exploring turn: one that could not beat the best predicted layout even then is not explored.
OPTIMISM = 1.0

ORDER, EXPLORE = "order", "exploration"


def explores(turn: int, share: float) -> bool:
    """Whether the ``turn``-th proposal (0-based) is an exploring one: evenly spread, ``share`` of them."""
    return share > 0 and math.floor((turn + 1) * share) > math.floor(turn * share)


class Ranked:
    """Chooses each proposal of a ``ranked`` study (``study.LayoutStudy``) from the sweep's step-time model."""

    def __init__(self, cfg: SweepConfig, model: StepModel, exploration: float = EXPLORATION) -> None:
        self.cfg, self.model, self.exploration = cfg, model, exploration

    def __call__(self, untried: Sequence[Layout], turn: int) -> tuple[Layout, str]:
        """The layout to propose among ``untried`` (ties: the first in their order) and why (ORDER or EXPLORE)."""
        predicted = {lo: predicted_objective(self.model, lo, self.cfg) for lo in untried}
        best = max(untried, key=predicted.__getitem__)
        if not explores(turn, self.exploration) or not self.model.samples:
            return best, ORDER
        pick = self.most_uncertain(untried, predicted)
        return (best, ORDER) if pick is None or pick == best else (pick, EXPLORE)

    def most_uncertain(self, untried: Sequence[Layout], predicted: dict[Layout, float]) -> Layout | None:
        """The untried layout with the widest predicted log step time among those whose objective could reach the
        best predicted one (untried or measured) at OPTIMISM standard deviations; None when none is unsure."""
        measured = [predicted_objective(self.model, lo, self.cfg) for lo in set(self.model.layouts)]
        bar = max([*predicted.values(), *measured])
        if bar <= 0:
            return None
        spread: dict[Layout, float] = {}
        for lo in untried:
            if predicted[lo] > 0:
                sd = self.model.log_sd(lo)
                if math.log(predicted[lo]) + OPTIMISM * sd >= math.log(bar):
                    spread[lo] = sd
        if not spread:
            return None
        pick = max(spread, key=spread.__getitem__)
        return pick if spread[pick] > 0 else None


__all__ = ["EXPLORATION", "EXPLORE", "OPTIMISM", "ORDER", "Ranked", "explores"]
