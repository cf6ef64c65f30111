"""Exploration: fill free capacity with proposals, wait for a trial to end, record it, repeat until the budget or the
launchable layouts are spent.

The study proposes only layouts the frontier (``search.propose.frontier``) holds launchable: the rules accept them,
memory does not rule them out, no measured trial dominates them and the backend can run them; a queued seed that is
not launchable is refused and recorded once, without launching. Infrastructure failures (a node lost, an actor
killed) are not the layout's fault: the same layout is re-queued as a new attempt of the same trial.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sweeper.config.schema import layout_from_string
from sweeper.plan.assess import PlanEntry, assess
from sweeper.record.schema import TrialResult
from sweeper.search.console import console
from sweeper.search.decide.candidates import trials_without_improvement
from sweeper.search.decide.verdicts import NOT_THE_LAYOUTS
from sweeper.search.propose.frontier import layout_key
from sweeper.search.propose.refit import turn as refit_proposal
from sweeper.search.run.scheduler import HOLD, Running
from sweeper.search.run.state import MAX_ATTEMPTS, SweepState, predicted
from sweeper.space.layout import Layout
from sweeper.trial.runner import HOST_OUT_OF_MEMORY

# In TPE mode on GPUs, the estimator's fastest predicted layouts are proposed first (a prior). Not on a simulated
# cluster: the estimator prices the GPUs its cluster section names, while the trials there measure CPU ranks sharing
# this machine's cores, where its favourites (more ranks, BF16) are among the slowest layouts (measured:
# benchmarks/search_efficiency.py on tests/data/landscape_quickstart.json, 12.5 trials with them vs 8.5 without).
PRIOR_PROPOSALS = 2


def prior_proposals(simulated: bool) -> int:
    """How many of the estimator's favourites open a TPE study (see PRIOR_PROPOSALS)."""
    return 0 if simulated else PRIOR_PROPOSALS


def explore(sweep: SweepState) -> None:
    """The exploration loop: ends when the sweep is stopped, or nothing is in flight, nothing waits for GPUs the
    capacity alive can hold (``run.capacity``) and nothing more launches."""
    sweep.ended_handlers["explore"] = lambda run, result: ended(sweep, run, result)
    seed_queue(sweep)
    while not sweep.stop.is_set():
        fill(sweep)
        if sweep.scheduler.in_flight:
            sweep.wait_one()
            continue
        # Nothing of the sweep's own runs: a proposal held for GPUs that other jobs hold waits for them (the wall-time
        # budget ends the wait); one the capacity alive can never hold was deferred and ends with the sweep.
        if not sweep.scheduler.retry or wall_time_spent(sweep):
            break
        head = sweep.scheduler.retry[0]
        sweep.capacity.idle(f"trial #{head.number}", head.layout)
    if not sweep.stop.is_set():
        defer_waiting(sweep)


def wall_time_spent(sweep: SweepState) -> bool:
    """``search.wall_time_s`` is spent (over every run of the sweep: ``--resume`` continues its clock)."""
    wall = sweep.cfg.search.wall_time_s
    return wall is not None and sweep.wall_s() > wall


def seed_queue(sweep: SweepState) -> None:
    if sweep.options.resume:
        for run_id in sweep.tracker.close_orphans():
            console.print(f"resume: MLflow run {run_id} of a trial running at the crash marked KILLED")
        missing = sweep.tracker.log_missing(sweep.records)  # trials that ended while MLflow was behind
        if missing:
            console.print(f"resume: {missing} trial attempt(s) recorded while MLflow was behind logged to it now")
        for layout, attrs in sweep.study.take_over_running(sweep.recorded_outcome):
            if "sweeper_number" in attrs:
                sweep.resumed[layout_key(layout.to_dict())] = (attrs["sweeper_number"], attrs.get("attempt", 1))
                sweep.study.enqueue(layout, again=True)
                console.print(f"resume: trial #{attrs['sweeper_number']} {layout.short()} was running at the "
                              "crash; it runs again as a new attempt")
        # Their numbers are taken: a trial that had no record yet may hold a number above every recorded one.
        sweep.next_number = max([sweep.next_number, *(1 + n for n, _ in sweep.resumed.values())])
    for text in sweep.cfg.search.seeds:
        sweep.study.enqueue(layout_from_string(sweep.cfg, text))
    if sweep.study.mode == "tpe":  # the estimator's two favourites open the study (a prior), then TPE takes over
        for entry in sweep.frontier.launchable[:prior_proposals(sweep.handle.simulated)]:
            if not sweep.frontier.taken(entry.layout):
                sweep.study.enqueue(entry.layout)
        enqueue_probe(sweep)


def enqueue_probe(sweep: SweepState) -> None:
    """TPE mode: queue the launchable layout inside the error band with the lowest predicted memory, one at a
    time, so that what the estimator cannot decide is measured (and calibrates it) early. A ranked study (the
    default) has no probe: its every proposal is its order's, and a layout in the band runs when its turn comes
    (one that runs out of memory is memory evidence against the layouts it bounds)."""
    if sweep.study.mode != "tpe" or sweep.probe is not None:
        return
    band = [e for e in sweep.frontier.launchable if e.uncertain and not sweep.frontier.taken(e.layout)]
    if band:
        sweep.probe = min(band, key=lambda e: e.predicted.memory_gib if e.predicted else 0.0).layout
        sweep.study.enqueue(sweep.probe)
        console.print(f"[blue]estimator[/] probe: {sweep.probe.short()} is inside the memory error band; "
                      "it runs to measure, not to be pruned")


def budget_left(sweep: SweepState) -> bool:
    waiting = sum(1 for r in sweep.scheduler.waiting if r.number not in sweep.counted)  # proposals held for GPUs
    if sweep.launched + waiting >= sweep.max_trials:
        return False
    if sweep.stopped_early is None and sweep.cfg.search.patience is not None:
        stale = trials_without_improvement(sweep.records, sweep.cfg, sweep.calibrator.current)
        if stale >= sweep.cfg.search.patience:
            sweep.stopped_early = (f"stopped exploring: {stale} trials without a better stable layout "
                                  f"(search.patience {sweep.cfg.search.patience})")
            console.print(f"[yellow]{sweep.stopped_early}[/]", important=True)
    if sweep.stopped_early is not None:
        return False
    if wall_time_spent(sweep):
        return False
    hours = sweep.cfg.search.gpu_hours
    return hours is None or sweep.gpu_s() / 3600 < hours


def fill(sweep: SweepState) -> None:
    sweep.scheduler.readmit()  # capacity came back (node join)
    while not sweep.stop.is_set() and sweep.scheduler.has_room():
        waiting = sweep.scheduler.take_retry()
        backfill = waiting == HOLD
        if backfill and not may_backfill(sweep):
            return  # wait for capacity (a lost node may come back, or running trials end)
        if isinstance(waiting, tuple):
            run, reserved = waiting
            # A proposal that waited for GPUs: what finished meanwhile may rule it out.
            if not run.started_at and admitted(sweep, run.layout, run.proposal, run.number) is None:
                sweep.handle.release(reserved)
                continue
            sweep.launch(run.layout, run.number, run.attempt + 1, "explore", run.proposal, run.predicted, reserved)
            continue
        if not budget_left(sweep):
            return
        # Never a decided or running layout, so this loop ends: each turn launches (budget), holds for GPUs
        # (return), or refuses a layout not refused before (a queued seed, or one calibration no longer fits),
        # recorded once; the study spends at most two asks per proposal. A backfill draws only layouts that
        # fit on the free GPUs now.
        taken = sweep.frontier.taken
        refused = (lambda lo: taken(lo) or not sweep.handle.fits(lo)) if backfill else taken
        refit_turn(sweep, refused)
        proposal = sweep.study.propose(refused)
        if proposal is None:
            return  # every launchable layout has been proposed (or, backfilling, none fits now)
        layout = proposal.layout
        entry = admitted(sweep, layout, proposal.trial)
        if entry is None:
            continue
        number, attempt = number_for(sweep, layout)
        slot = sweep.handle.reserve(layout)
        if slot is None:
            held = Running(number, attempt, "explore", layout, proposal.trial, predicted(entry), None, "", None)
            if backfill:  # its GPUs were taken since: it waits behind the head
                sweep.scheduler.retry_later(held)
                return
            # First in line when GPUs free up (or deferred: nodes were lost); the GPUs left free may take a
            # smaller trial meanwhile (backfill).
            sweep.scheduler.hold(held)
            continue
        if backfill:
            head = sweep.scheduler.retry[0]
            sweep.backfilled.append(number)
            console.print(f"[blue]backfill[/] #{number} {layout.short()} runs on free GPUs while #{head.number} "
                          f"waits for {head.layout.world_size}")
        sweep.launch(layout, number, attempt + 1, "explore", proposal.trial, predicted(entry), slot)


def refit_turn(sweep: SweepState, refused: Callable[[Layout], bool]) -> None:
    """TPE mode: queue the refit step-time model's best untried launchable layout (``search.propose.refit``),
    once it has the samples for a turn and nothing else is queued (seeds, the estimator's favourites, the probe)."""
    if sweep.study.mode != "tpe" or sweep.study.has_queued():
        return
    untried = [e.layout for e in sweep.frontier.launchable if not refused(e.layout)]
    choice = refit_proposal(sweep.calibrator.step, sweep.cfg, untried)
    if choice is not None:
        sweep.study.enqueue(choice)


def may_backfill(sweep: SweepState) -> bool:
    """A smaller proposal may start while the head of the queue waits for GPUs (``Scheduler.may_backfill``),
    but never ahead of a queued layout (seeds, the estimator's favourites): those are proposed in order."""
    return sweep.scheduler.may_backfill() and not sweep.study.has_queued()


def number_for(sweep: SweepState, layout: Layout) -> tuple[int, int]:
    """(sweeper trial number, attempts so far): a trial that was running when a driver died keeps its number."""
    resumed = sweep.resumed.pop(layout_key(layout.to_dict()), None)
    if resumed is not None:
        return resumed
    sweep.next_number += 1
    return sweep.next_number - 1, 0


def admitted(sweep: SweepState, layout: Layout, trial: Any, number: int | None = None) -> PlanEntry | None:
    """The layout's plan entry as it stands now, or None after recording it as pruned (the rules, memory or the
    backend refuse it; ``number``: the trial number it already holds)."""
    entry, reason = sweep.frontier.assess(layout)
    if reason is None:
        return entry
    sweep.record_pruned(entry, reason, trial, number=number)
    return None


def defer_waiting(sweep: SweepState) -> None:
    """Layouts still waiting for GPUs when exploring ended (nodes were lost, so the capacity alive can never hold
    them; or the wall-time budget ended the wait): recorded, not dropped."""
    for run in sweep.scheduler.drain_waiting():
        never = sweep.capacity.never(run.layout)
        alive, others = sweep.handle.capacity_total(), sweep.handle.held_by_others()
        text = ("deferred: " + (never or f"needs {run.layout.world_size} GPUs, {alive} alive"
                                + (f" ({others} held by other jobs)" if others else "")) + " when exploring ended")
        entry = assess(sweep.cfg, run.layout)
        sweep.record_pruned(entry, (text, "infra"), run.proposal, number=run.number)


def ended(sweep: SweepState, run: Running, result: TrialResult) -> None:
    """An explored attempt ended and was recorded: the probe moves on; a failure not the layout's runs again (up to
    ``MAX_ATTEMPTS``); otherwise the layout is decided and Optuna told."""
    if run.layout == sweep.probe:
        sweep.probe = None
        if result.passed:
            enqueue_probe(sweep)
    killed = sweep.stop.is_set() and result.failure_kind in ("infra", "timeout", None)
    if result.failure_kind in NOT_THE_LAYOUTS and not sweep.stop.is_set():
        # On a simulated cluster every node is this machine: ranks killed for its host memory would be again.
        exhausted = sweep.handle.simulated and HOST_OUT_OF_MEMORY in result.notes
        if exhausted:
            console.print(f"[yellow]not re-run[/] #{run.number}: its {len(result.rank_nodes) or 'many'} ranks "
                          f"need more memory than this machine has (not the layout's fault)", important=True)
        elif run.attempt < MAX_ATTEMPTS[result.failure_kind]:
            sweep.scheduler.retry_later(run)
            return
    if sweep.stop.is_set() and killed:
        return  # the layout said nothing: left open, re-run on --resume
    sweep.frontier.decide(run.layout)
    sweep.study.tell(run.proposal, *sweep.outcome(result, run.layout))
