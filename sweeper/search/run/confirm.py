"""Confirmation: the best candidates run again with more steps (and routing stress) until ``search.confirm_top`` of
them passed."""

from __future__ import annotations

from sweeper.search.decide.candidates import candidates, confirm_attempts
from sweeper.search.run.state import MAX_ATTEMPTS, SweepState


def confirm(sweep: SweepState) -> None:
    """Re-run the best candidates with more steps until ``confirm_top`` of them passed their confirmation
    (a candidate that fails it is dropped and the next one is tried; at most 2 x confirm_top runs)."""
    wanted = sweep.cfg.search.confirm_top
    budget = 2 * wanted
    while wanted and not sweep.stop.is_set():
        cands = candidates(sweep.records, sweep.cfg)
        good = [c for c in cands if c.confirmations and c.confirmed(sweep.cfg)]
        pending = {r.number for r in sweep.scheduler.in_flight if r.phase == "confirm"}
        # A confirmation lost to a fault that is not the layout's (a node, a placement timeout) is made again,
        # up to the attempts an exploration gets; it spends none of the budget of candidates tried.
        todo = [c for c in cands if not c.confirmations and c.number not in pending
                and confirm_attempts(sweep.records, c.number)[1] < MAX_ATTEMPTS["infra"]]
        slot = None
        retry = bool(todo) and confirm_attempts(sweep.records, todo[0].number)[1] > 0
        if len(good) + len(pending) < wanted and (budget > 0 or retry) and todo:
            slot = sweep.handle.reserve(todo[0].layout, alone=sweep.confirm_alone())
        if slot is not None:
            budget -= 0 if retry else 1
            attempt = confirm_attempts(sweep.records, todo[0].number)[0] + 1
            sweep.launch(todo[0].layout, todo[0].number, attempt, "confirm", None, todo[0].explore.predicted,
                         slot)
        elif sweep.scheduler.in_flight:
            sweep.wait_one()
        else:
            break
