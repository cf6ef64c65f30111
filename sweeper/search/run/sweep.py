"""The sweep (``Sweep.run``): its phases in order. The equivalence reference (``run.reference``), exploration (Optuna
proposes, ``search.propose``; the scheduler launches trials on free GPUs, ``run.scheduler``; MLflow records),
confirmation of the top candidates (``run.confirm``), and the end: the winner exported, the report written
(``run.finish``). What the phases share is ``run.state.SweepState``.
"""

from __future__ import annotations

from sweeper.search.console import console
from sweeper.search.run.confirm import confirm
from sweeper.search.run.explore import explore
from sweeper.search.run.finish import finish
from sweeper.search.run.reference import make_reference
from sweeper.search.run.state import SearchOptions, SweepState, now

__all__ = ["SearchOptions", "Sweep", "now"]


class Sweep(SweepState):
    """One sweep: state lives in ``SweepState``, the phases run in ``run``."""

    def run(self) -> int:
        started = self.handle.prestart([e.layout for e in self.frontier.launchable])
        if started:
            console.print(f"starting {started} warm ranks beside the reference run")
        make_reference(self)
        explore(self)
        if not self.stop.is_set():
            confirm(self)
        if self.stop.is_set():  # while exploring or confirming: running trials are cancelled, not left to the end
            self.cancel_all()
            return finish(self, "failed" if self.halted else "interrupted")
        return finish(self, "finished")
