"""What `sweeper plan`'s table shows: the valid layouts, launchable first and best first by the sweep's objective
as the production run would run each, with those objectives; the space's size; the invalid layouts' reasons by how
many layouts each rejects. A large space's made on the cores this process may use, as `plan --json`'s (issue 54)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sweeper.config.schema import SweepConfig
from sweeper.estimate.calibration import Calibration
from sweeper.plan.assess import Plan, PlanEntry, invalid_reasons, judge_space
from sweeper.plan.shards import BLOCK, Layouts, in_workers, merged_order, plan_share, split
from sweeper.search.decide.objective import predicted_objectives


@dataclass(frozen=True)
class PlanTable:
    layouts: int  # the space's (after --only)
    valid: list[PlanEntry]  # launchable first, best first; ties in the plan's order
    objectives: list[float | None]  # each valid layout's predicted objective, projected to the production run
    reasons: list[tuple[str, int]]  # ``invalid_reasons``: each reason and how many layouts it rejects

    @classmethod
    def of(cls, cfg: SweepConfig, entries: list[PlanEntry]) -> PlanTable:
        """The table of a plan's ``entries`` (``Plan.entries``: in the plan's order)."""
        valid = [e for e in entries if e.valid]
        objectives = predicted_objectives(cfg, [e.layout for e in valid], [e.predicted for e in valid])
        return cls(len(entries), *ranked(valid, objectives), invalid_reasons(entries))


def ranked(valid: list[PlanEntry], objectives: list[float | None],
           ) -> tuple[list[PlanEntry], list[float | None]]:
    """``valid`` (in the plan's order) and their ``objectives``, launchable first, best first."""
    order = sorted(range(len(valid)), key=lambda i: (not valid[i].launchable, -(objectives[i] or 0.0)))
    return [valid[i] for i in order], [objectives[i] for i in order]


def plan_table(cfg: SweepConfig, layouts: Layouts, calibration: Calibration | None,
               workers: int | None = None, block: int = BLOCK) -> PlanTable:
    """``PlanTable.of`` the plan of ``layouts`` (the space's, in its order) under ``calibration``; a large space's on
    the cores this process may use, as ``plan --json``'s (sweeper/plan/shards.py): each worker judges and predicts
    its blocks and prices its valid layouts' objectives, and the merge puts them in the plan's order (``order_keys``,
    ties in the space's) before ranking them as one process does. The same table whatever the workers (a test)."""
    blocks, workers = split(len(layouts), workers, block)
    if workers <= 1:
        return PlanTable.of(cfg, Plan.of(*judge_space(cfg, layouts.layouts(), calibration), calibration).entries())
    parts = in_workers(lambda w: _part(cfg, layouts, blocks, range(w, len(blocks), workers), calibration), workers)
    entries = [e for p in parts for e in p.valid]
    objectives = [o for p in parts for o in p.objectives]
    order = merged_order(parts)
    # ``invalid_reasons``' order: most layouts first, ties in the order a reason first appears over the space
    counts: dict[str, list[Any]] = {}
    for p in parts:
        for reason, (count, seen) in p.reasons.items():
            total = counts.setdefault(reason, [0, seen])
            total[0] += count
            total[1] = min(total[1], seen)
    reasons = [(reason, total[0]) for reason, total in sorted(counts.items(), key=lambda kv: (-kv[1][0], kv[1][1]))]
    return PlanTable(len(layouts), *ranked([entries[i] for i in order], [objectives[i] for i in order]), reasons)


@dataclass(frozen=True)
class _Part:
    """A worker's part of the table: its valid entries (in the space's order) with their places in the space, their
    keys in the plan's order and their objectives; each invalid reason with how many of its layouts it rejects and
    where it first appears (the layout's place in the space, the reason's place among that layout's reasons)."""

    index: np.ndarray
    group: np.ndarray
    first: np.ndarray
    second: np.ndarray
    valid: list[PlanEntry]
    objectives: list[float | None]
    reasons: dict[str, tuple[int, tuple[int, int]]]


def _part(cfg: SweepConfig, layouts: Layouts, blocks: Sequence[range], share: range,
          calibration: Calibration | None) -> _Part:
    """One worker's part: its layouts planned (``plan_share``) and its valid ones priced."""
    mine = plan_share(cfg, layouts, blocks, share, calibration)
    plan = mine.plan
    entries = [PlanEntry(e.layout, e.reasons, p) for e, p in
               zip((e for e in plan.judged if not e.reasons), plan.predictions.estimates(), strict=True)]
    objectives = predicted_objectives(cfg, [e.layout for e in entries], [e.predicted for e in entries])
    reasons: dict[str, tuple[int, tuple[int, int]]] = {}
    for place, e in zip(mine.places.tolist(), plan.judged, strict=True):
        for k, reason in enumerate(e.reasons):
            count, seen = reasons.get(reason, (0, (place, k)))
            reasons[reason] = (count + 1, seen)
    return _Part(mine.index, mine.group, mine.first, mine.second, entries, objectives, reasons)
