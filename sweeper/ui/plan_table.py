"""What `sweeper plan`'s table shows: the valid layouts, launchable first and best first by the sweep's objective
as the production run would run each, with those objectives; the space's size; the invalid layouts' reasons by how
many layouts each rejects."""

from __future__ import annotations

from dataclasses import dataclass

from sweeper.config.schema import SweepConfig
from sweeper.plan.assess import PlanEntry, invalid_reasons
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
