"""Confirmation: the best candidates run again with more steps (and routing stress) until ``search.confirm_top`` of
them confirmed (``Candidate.confirmed``: every confirmation run stable and steady, the verdict the winner is chosen
by).

A candidate whose confirmation says something about the layout and does not confirm (it failed, ran over the memory
headroom under routing stress, its loss and gradient-norm trajectory left the reference layout's, or its step time
drifted) is dropped and the next one is tried: at most 2 x confirm_top candidates.
A confirmation lost to a fault that is not the layout's (a node, a placement timeout) is made again, up to the
attempts an exploration gets, and spends none of that budget. Its GPUs are waited for as exploration's are
(``run.capacity``): held by other jobs, they free up; a candidate the capacity alive can never hold is passed over,
saying so.
"""

from __future__ import annotations

from sweeper.search.console import console
from sweeper.search.decide.candidates import Candidate, candidates, confirm_attempts
from sweeper.search.run.explore import wall_time_spent
from sweeper.search.run.reference import ensure_trajectory
from sweeper.search.run.state import MAX_ATTEMPTS, SweepState


def confirm(sweep: SweepState) -> None:
    wanted = sweep.cfg.search.confirm_top
    budget = 2 * wanted  # candidates tried (their first confirmation launched)
    passed_over: set[int] = set()  # candidates the capacity alive can never hold
    while wanted and not sweep.stop.is_set():
        cands = candidates(sweep.records, sweep.cfg, sweep.calibrator.current)
        good = [c for c in cands if c.confirmed(sweep.cfg)]
        pending = {r.number for r in sweep.scheduler.in_flight if r.phase == "confirm"}
        head = _next(sweep, cands, pending, passed_over) if len(good) + len(pending) < wanted else None
        retry = head is not None and confirm_attempts(sweep.records, head.number)[1] > 0
        if head is not None and (budget > 0 or retry):
            never = sweep.capacity.never(head.layout)
            if never is not None:
                passed_over.add(head.number)
                console.print(f"[yellow]not confirmed[/] #{head.number} {head.layout.short()}: the capacity alive can "
                              f"never hold it ({never}); the next candidate is tried", important=True)
                continue
            ensure_trajectory(sweep, head.layout)  # what the confirmation's whole run is held against
            slot = sweep.handle.reserve(head.layout, alone=sweep.confirm_alone())
            if slot is not None:
                budget -= 0 if retry else 1
                attempt = confirm_attempts(sweep.records, head.number)[0] + 1
                while sweep.dir.trial_dir(head.number, attempt, "confirm").exists():
                    attempt += 1  # a confirmation running when a driver died left its folder, and no record
                sweep.launch(head.layout, head.number, attempt, "confirm", None, head.explore.predicted, slot)
                continue
            if not sweep.scheduler.in_flight:
                if wall_time_spent(sweep):
                    console.print(f"[yellow]not confirmed[/] #{head.number} {head.layout.short()}: its GPUs were "
                                  "still held when search.wall_time_s was spent", important=True)
                    return
                sweep.capacity.idle(f"the confirmation of #{head.number}", head.layout)
                continue
        if sweep.scheduler.in_flight:
            sweep.wait_one()
        else:
            return


def _next(sweep: SweepState, cands: list[Candidate], pending: set[int], passed_over: set[int]) -> Candidate | None:
    """The best candidate with no confirmation verdict yet (none running, attempts lost to faults left)."""
    return next((c for c in cands if not c.confirmations and c.number not in pending and c.number not in passed_over
                 and confirm_attempts(sweep.records, c.number)[1] < MAX_ATTEMPTS["infra"]), None)
