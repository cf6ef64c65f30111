"""`sweeper plan`: every layout of a space, valid or not and why, with the estimator's prediction.

Instant and offline: imports neither torch, ray nor megatron. Each entry is the contract's JSON element
``{"layout", "valid", "reasons", "predicted"}``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from sweeper.config.schema import SweepConfig
from sweeper.estimate import Estimate, Estimator
from sweeper.estimate.calibration import Calibration
from sweeper.estimate.term_table import Predictions, TermTable, without_cycle_collection
from sweeper.plan.rules import Checker, check
from sweeper.plan.space import enumerate_layouts, matches
from sweeper.space.layout import Layout

_NO_PREDICTION = {"memory_gib": None, "fits": None, "step_time_s": None, "tokens_per_s": None,
                  "memory_band_gib": None, "may_fit": None, "step_time_terms_s": None}


@dataclass(frozen=True)
class PlanEntry:
    layout: Layout
    reasons: list[str]
    predicted: Estimate | None

    @property
    def valid(self) -> bool:
        return not self.reasons

    @property
    def launchable(self) -> bool:
        """Valid, and the measured peak may fit: pruned as out of memory only when even the lower end of the
        estimator's error band exceeds the limit (issue 13)."""
        return self.valid and self.predicted is not None and self.predicted.may_fit

    @property
    def uncertain(self) -> bool:
        """Launchable although predicted over the limit: inside the error band (a calibration probe)."""
        return self.launchable and self.predicted is not None and self.predicted.uncertain

    def to_json(self) -> dict[str, Any]:
        return _entry_json(self.layout, self.reasons,
                           self.predicted.to_json() if self.predicted else _NO_PREDICTION.copy())


def _entry_json(layout: Layout, reasons: list[str], predicted: dict[str, Any]) -> dict[str, Any]:
    """The contract's JSON element of one layout, ``predicted`` its Estimate's JSON (or ``_NO_PREDICTION``'s)."""
    return {"layout": layout.to_dict(), "valid": not reasons, "reasons": reasons, "predicted": predicted}


@dataclass(frozen=True)
class Plan:
    """A space's layouts judged by the rules, the valid ones predicted through their term table, in the plan's
    order (``build_plan``'s): its entries, or their JSON made from the predictions' arrays a column at a time
    instead of one Estimate at a time (a plan of DeepSeek-V3's space writes 53,739 of them, issue 54)."""

    judged: list[PlanEntry]  # the rules' verdicts, none predicted, in the space's order
    predictions: Predictions  # of the valid ones, in the same order
    order: list[int]  # indices into ``judged``, in the plan's order
    row: list[int]  # each valid entry's row in ``predictions`` (by its index in ``judged``)

    @classmethod
    def build(cls, cfg: SweepConfig, only: dict[str, Any] | None = None,
              calibration: Calibration | None = None) -> Plan:
        return cls.of(*judge_space(cfg, space_layouts(cfg, only), calibration), calibration)

    @classmethod
    def of(cls, judged: list[PlanEntry], table: TermTable, calibration: Calibration | None) -> Plan:
        """The plan of ``judged`` (the rules' verdicts) with ``table`` (of its valid layouts) under ``calibration``."""
        predicted = table.predict(calibration)
        valid = np.array([e.valid for e in judged], dtype=bool)
        row = np.cumsum(valid) - 1  # each valid entry's row in the table
        return cls(judged, predicted, _plan_order(valid, row, predicted), row.tolist())

    def __len__(self) -> int:
        return len(self.judged)

    def entries(self) -> list[PlanEntry]:
        """The entries, each valid one with its Estimate."""
        with without_cycle_collection():
            predicted = iter(self.predictions.estimates())
            entries = [e if not e.valid else PlanEntry(e.layout, e.reasons, next(predicted)) for e in self.judged]
            return [entries[i] for i in self.order]

    def to_json(self) -> list[dict[str, Any]]:
        """The contract's JSON array: ``[e.to_json() for e in self.entries()]``, equal to it (the invalid layouts'
        ``predicted`` one object: the array is for writing)."""
        return list(itertools.chain.from_iterable(self.json_parts(len(self.order) or 1)))

    def json_parts(self, size: int = 4096) -> Iterator[list[dict[str, Any]]]:
        """``to_json``'s array in consecutive parts of ``size`` elements: a writer encodes each part and lets it go
        before the next is made, instead of holding the whole tree (a DeepSeek-V3 plan's is most of a gigabyte)."""
        with without_cycle_collection():
            for start in range(0, len(self.order), size):
                yield self.json_of(self.order[start:start + size])

    def json_of(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The contract's JSON element of each entry in ``indices`` (into ``judged``), in that order, the valid
        ones' predictions made from the arrays a column at a time."""
        judged, row = self.judged, self.row
        # An entry is valid where it has no reasons (``PlanEntry.valid``, read here without its call: a plan writes a
        # hundred thousand of them)
        predicted = iter(self.predictions.json_of([row[i] for i in indices if not judged[i].reasons]))
        return [_entry_json(e.layout, e.reasons, _NO_PREDICTION if e.reasons else next(predicted))
                for e in (judged[i] for i in indices)]

    def json_text(self, size: int = 4096) -> Iterator[bytes]:
        """``json_parts`` encoded: each part's elements as JSON text, comma-separated, without the array's brackets
        (orjson: the same values as json.dumps, without spaces, a float's exponent as 1e-5 rather than 1e-05)."""
        for part in self.json_parts(size):
            yield orjson.dumps(part)[1:-1]


def assess(cfg: SweepConfig, layout: Layout, calibration: Calibration | None = None,
           checker: Checker | None = None, estimator: Estimator | None = None, production: bool = True,
           predict: bool = True) -> PlanEntry:
    """Rules, then (for valid layouts) the estimator. ``checker`` and ``estimator``: a space's ``Checker`` and
    ``Estimator`` (many layouts; the estimator's calibration is then its own, not ``calibration``). ``production``:
    the layout is a trial of the production run, whose batch it must share evenly with its copies (false for the
    equivalence reference, whose batch is its own). ``predict``: false leaves ``predicted`` None (the rules only: the
    caller predicts the valid layouts itself)."""
    reasons = (checker(layout) if checker is not None
               else check(cfg.model, layout, cfg.cluster, cfg.training.seq_length, cfg.run))
    reasons = _sharing(cfg.production_batch_reason(layout.world_size) if production else None, reasons)
    predicted = None
    if not reasons and predict:
        predicted = (estimator or Estimator.for_config(cfg, calibration))(layout)
    return PlanEntry(layout, reasons, predicted)


def judge(cfg: SweepConfig, layouts: list[Layout], checker: Checker) -> list[PlanEntry]:
    """``assess`` of each layout with ``predict`` false (the rules only), the production batch's verdict taken once
    per world size instead of once per layout."""
    shared = {w: cfg.production_batch_reason(w) for w in {layout.world_size for layout in layouts}}
    return [PlanEntry(layout, _sharing(shared[layout.world_size], checker(layout)), None) for layout in layouts]


def _sharing(shared: str | None, reasons: list[str]) -> list[str]:
    """The rules' ``reasons`` after the production batch's: first, since the rules judged a rounded share."""
    return [shared, *reasons] if shared else reasons


def build_plan(cfg: SweepConfig, only: dict[str, Any] | None = None,
               calibration: Calibration | None = None) -> list[PlanEntry]:
    """Valid layouts first: those predicted to fit by predicted throughput, then those inside the estimator's error
    band (lowest predicted memory first), then those over the band; then the invalid ones."""
    return Plan.build(cfg, only, calibration).entries()


def _plan_order(valid: np.ndarray, row: np.ndarray, p: Predictions) -> list[int]:
    """``build_plan``'s order, from the arrays: ``order_keys`` in turn, ties in the space's order."""
    if not valid.any():
        return list(range(len(valid)))
    return np.lexsort((np.arange(len(valid)), *reversed(order_keys(valid, row, p)))).tolist()


def order_keys(valid: np.ndarray, row: np.ndarray, p: Predictions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each layout's keys in the plan's order, each layout's from its own prediction: the valid layouts predicted to
    fit (group 1) by predicted throughput, then those inside the band (2) by predicted memory, then those over it
    (3) by predicted memory, then the invalid ones (4). ``row``: each valid layout's row in ``p``."""
    at = np.where(valid, row, 0)
    fits, may_fit, memory = p.fits[at], p.may_fit[at], p.memory_gib[at]
    tokens = np.where(p.step_time_s[at] > 0, p.tokens_per_s[at], 0.0)  # an Estimate's tokens_per_s is None else
    group = np.where(~valid, 4, np.where(fits, 1, np.where(may_fit, 2, 3)))
    first = np.where(~valid, 0.0, np.where(fits, -tokens, memory))
    second = np.where(valid & fits, memory, 0.0)
    return group, first, second


def assess_all(cfg: SweepConfig, layouts: list[Layout], calibration: Calibration | None = None) -> list[PlanEntry]:
    """``assess`` for many layouts of the space, with one rule checker and one estimator for all of them."""
    return list(assess_each(cfg, layouts, calibration))


def assess_each(cfg: SweepConfig, layouts: Iterable[Layout], calibration: Calibration | None = None,
                production: bool = True) -> Iterator[PlanEntry]:
    """``assess_all`` one layout at a time, for a caller that may stop at the first that serves."""
    checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length, cfg.run)
    estimator = Estimator.for_config(cfg, calibration)
    return (assess(cfg, lo, calibration, checker, estimator, production) for lo in layouts)


def assess_tabled(cfg: SweepConfig, layouts: list[Layout], calibration: Calibration | None = None,
                  ) -> tuple[list[PlanEntry], TermTable]:
    """``assess_all``, the valid layouts predicted through their term table (returned too: a later calibration
    re-predicts them with ``repredict`` in one vectorised pass)."""
    judged, table = judge_space(cfg, layouts, calibration)
    return repredict(judged, table, calibration), table


def space_layouts(cfg: SweepConfig, only: dict[str, Any] | None = None) -> list[Layout]:
    """The space's layouts (``enumerate_layouts``) that ``--only`` keeps, in the space's order."""
    return [lo for lo in enumerate_layouts(cfg) if matches(lo, only or {})]


def judge_space(cfg: SweepConfig, layouts: list[Layout], calibration: Calibration | None,
                ) -> tuple[list[PlanEntry], TermTable]:
    """The rules' verdict on each layout (none predicted) and the term table of the valid ones, in order."""
    checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length, cfg.run)
    judged = judge(cfg, layouts, checker)
    return judged, TermTable.build(Estimator.for_config(cfg, calibration), [e.layout for e in judged if e.valid])


def repredict(entries: list[PlanEntry], table: TermTable, calibration: Calibration | None) -> list[PlanEntry]:
    """``entries`` with the rules' verdicts kept and the valid ones (``table``'s layouts, in order) predicted under
    ``calibration`` from the table: equal to ``reassess`` with the space's estimator so calibrated."""
    with without_cycle_collection():
        predicted = iter(table.estimates(calibration))
        return [e if not e.valid else PlanEntry(e.layout, e.reasons, next(predicted)) for e in entries]


def reassess(entries: list[PlanEntry], estimator: Estimator) -> list[PlanEntry]:
    """``entries`` (assessed before, under any calibration) with the rules' verdicts kept, which no calibration
    changes, and each valid layout predicted again by ``estimator`` (the space's, under the new calibration)."""
    return [e if not e.valid else PlanEntry(e.layout, e.reasons, estimator(e.layout)) for e in entries]


def invalid_reasons(entries: list[PlanEntry]) -> list[tuple[str, int]]:
    """Distinct reasons with how many layouts each rejects, most common first."""
    counts = Counter(reason for e in entries for reason in e.reasons)
    return counts.most_common()
