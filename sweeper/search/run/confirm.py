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

At scale (``search.confirm_at_scale``, issue 53): once enough candidates confirmed, the one the choice would take
runs once more as the production run runs it, its copies side by side as one run of N GPUs on the production
batch (or, where the cluster alive cannot hold N, the most copies it can hold), and that run's measurement is its
figure. A layout that fails at scale does not win, and the next candidate is confirmed; one that measures below
another candidate's projection hands the choice to that one, which is run at scale in turn (each at most once).
"""

from __future__ import annotations

from typing import Any

from sweeper.plan.assess import assess
from sweeper.search.console import console
from sweeper.search.decide.candidates import Candidate, candidates, choose, confirm_attempts, run_gpus
from sweeper.search.decide.verdicts import NOT_THE_LAYOUTS
from sweeper.search.run.explore import wall_time_spent
from sweeper.search.run.reference import ensure_trajectory
from sweeper.search.run.state import MAX_ATTEMPTS, SweepState
from sweeper.space.layout import Layout


def confirm(sweep: SweepState) -> None:
    wanted = sweep.cfg.search.confirm_top
    budget = 2 * wanted  # candidates tried (their first confirmation launched)
    passed_over: set[int] = set()  # candidates the capacity alive can never hold
    not_at_scale: set[int] = set()  # candidates whose run at scale cannot be made
    while wanted and not sweep.stop.is_set():
        cands = candidates(sweep.records, sweep.cfg, sweep.calibrator.current)
        good = [c for c in cands if c.confirmed(sweep.cfg)]
        pending = {r.number for r in sweep.scheduler.in_flight if r.phase == "confirm"}
        head = _next(sweep, cands, pending, passed_over) if len(good) + len(pending) < wanted else None
        layout = head.layout if head is not None else None
        retry = head is not None and confirm_attempts(sweep.records, head.number)[1] > 0
        if head is None and not pending and sweep.cfg.search.confirm_at_scale:
            head, layout = _at_scale_next(sweep, cands, not_at_scale)
            retry = True  # spends none of the candidates' budget: at most one run at scale per candidate
        if head is not None and layout is not None and (budget > 0 or retry):
            never = sweep.capacity.never(layout)
            if never is not None:
                passed_over.add(head.number)
                console.print(f"[yellow]not confirmed[/] #{head.number} {layout.short()}: the capacity alive can "
                              f"never hold it ({never}); the next candidate is tried", important=True)
                continue
            ensure_trajectory(sweep, layout)  # what the confirmation's whole run is held against
            slot = sweep.handle.reserve(layout, alone=sweep.confirm_alone())
            if slot is not None:
                budget -= 0 if retry else 1
                attempt = max((r.attempt for r in head.attempts), default=0) + 1
                while sweep.dir.trial_dir(head.number, attempt, "confirm").exists():
                    attempt += 1  # a confirmation running when a driver died left its folder, and no record
                sweep.launch(layout, head.number, attempt, "confirm", None, _predicted(sweep, head, layout), slot)
                continue
            if not sweep.scheduler.in_flight:
                if wall_time_spent(sweep):
                    console.print(f"[yellow]not confirmed[/] #{head.number} {layout.short()}: its GPUs were "
                                  "still held when search.wall_time_s was spent", important=True)
                    return
                sweep.capacity.idle(f"the confirmation of #{head.number}", layout)
                continue
        if sweep.scheduler.in_flight:
            sweep.wait_one()
        else:
            return


def _next(sweep: SweepState, cands: list[Candidate], pending: set[int], passed_over: set[int]) -> Candidate | None:
    """The best candidate with no confirmation verdict yet (none running, attempts lost to faults left)."""
    return next((c for c in cands if not c.confirmations and c.number not in pending and c.number not in passed_over
                 and confirm_attempts(sweep.records, c.number)[1] < MAX_ATTEMPTS["infra"]), None)


def _at_scale_next(sweep: SweepState, cands: list[Candidate],
                   given_up: set[int]) -> tuple[Candidate | None, Layout | None]:
    """The candidate the choice would take and the layout of its run at scale, while it has none: its production
    layout where the capacity alive can hold it, else the most copies it can hold; (None, None) when nothing is to
    be run (a candidate measured at the production run's size, or whose run at scale cannot be made, saying so)."""
    winner = choose(cands, sweep.cfg)
    if winner is None or winner.at_scale is not None or winner.number in given_up:
        return None, None
    larger = sweep.cfg.at_scale_layouts(winner.layout)
    if not larger:  # its trial ran on the production run's GPUs (or N holds one copy of it)
        return None, None
    lost = [r for r in winner.attempts if run_gpus(r) > winner.layout.world_size
            and r.result.failure_kind in NOT_THE_LAYOUTS]
    target = next((lo for lo in larger if sweep.capacity.never(lo) is None), None)
    if target is None or len(lost) >= MAX_ATTEMPTS["infra"]:
        given_up.add(winner.number)
        why = (f"its runs at scale were lost to faults not the layout's {len(lost)} times" if target is not None else
               f"the capacity alive holds no {2 * winner.layout.world_size} GPUs")
        console.print(f"[yellow]at scale[/] #{winner.number} {winner.layout.short()} is not run as the production "
                      f"run's {sweep.cfg.production_gpus} GPUs: {why}; its figure stays projected", important=True)
        return None, None
    if target != larger[0]:
        console.print(f"[blue]at scale[/] #{winner.number}: the capacity alive holds {target.world_size} of the "
                      f"production run's {sweep.cfg.production_gpus} GPUs: confirmed at {target.short()}, the rest "
                      "projected with the calibration that run refits")
    return winner, target


def _predicted(sweep: SweepState, head: Candidate, layout: Layout) -> dict[str, Any] | None:
    """What the confirmation's record says was predicted: its trial's prediction, or (at scale) the estimator's for
    the layout it runs."""
    if layout == head.layout:
        return head.explore.predicted
    made = assess(sweep.cfg, layout).predicted
    return made.to_json() if made is not None else None
