"""The equivalence reference: made once before the first trial, loaded (resharded) by every trial's gate
(``trial.reference``); and the reference layout's trajectory a confirmation is held against, made before the first
confirmation of each batch, micro-batch size and precision (``ensure_trajectory``).

Its GPUs are waited for as any trial's (``run.capacity``) and a fault that is not the layout's (a node lost, a rank
that could not start) is retried as a trial's is (``MAX_ATTEMPTS``). When it still cannot be made, no trial could
be stable: with ``search.require_equivalence`` on (the default) the sweep stops before its first trial, with exit 1
and one line, instead of spending its budget on trials that cannot win. A reference layout that fails for its own
reasons (out of memory: the estimator let it through inside its error band) gives way to the next simplest layout.
"""

from __future__ import annotations

from pathlib import Path

from sweeper.search.console import console
from sweeper.search.decide.verdicts import NOT_THE_LAYOUTS
from sweeper.search.run.state import MAX_ATTEMPTS, SweepState
from sweeper.space.layout import Layout
from sweeper.trial.protocol import Reservation
from sweeper.trial.reference import (
    NO_REFERENCE_LAYOUT,
    ReferenceOutcome,
    Trajectory,
    TrajectoryKey,
    existing_reference,
    read_trajectory,
    reference_layouts,
    run_reference,
    run_trajectory,
    trajectory_file,
    trajectory_key,
    trajectory_layout,
    written_layout,
)

# Layouts tried for the reference when each fails for its own reasons (out of memory inside the estimator's band):
# the simplest without and with full recompute, then the next simplest likewise.
LAYOUTS_TRIED = 4


def make_reference(sweep: SweepState) -> None:
    folder = sweep.dir.root / "reference"
    outcome = existing_reference(sweep.cfg, folder) or _made(sweep, folder)
    sweep.reference = outcome.path
    if outcome.path is not None or not sweep.stop.is_set():
        console.print(f"[blue]equivalence[/] {outcome.note}")
    meta = sweep.dir.read_meta()
    meta.reference = outcome.to_json()
    sweep.dir.write_meta(meta)
    if outcome.path is not None or sweep.stop.is_set():
        return
    if sweep.cfg.search.require_equivalence:
        sweep.halted = (f"stopped before the first trial: the equivalence reference could not be made "
                        f"({outcome.note.removeprefix('equivalence gate off: ')}), so no trial could prove it "
                        "computes the model (search.require_equivalence: false runs the sweep without the gate)")
        sweep.stop.set()
        return
    console.print("[yellow]equivalence[/] without the reference no trial proves it computes the model: "
                  "search.require_equivalence is false, so passed trials may still be stable", important=True)


def _made(sweep: SweepState, folder: Path) -> ReferenceOutcome:
    """Wait for the reference layout's GPUs, make it, retry faults that are not the layout's; a layout that fails
    for its own reasons (out of memory) gives way to the next candidate (``trial.reference.reference_layouts``:
    itself with full recompute, then the next simplest), up to ``LAYOUTS_TRIED``."""
    outcome = ReferenceOutcome(None, None, NO_REFERENCE_LAYOUT)
    for tried, layout in enumerate(reference_layouts(sweep.cfg, sweep.handle)):
        if tried == LAYOUTS_TRIED or sweep.stop.is_set():
            break
        if tried:
            console.print(f"[yellow]equivalence[/] {outcome.note.removeprefix('equivalence gate off: ')}; "
                          f"{layout.short()} makes the reference instead", important=True)
        outcome, kind = _made_in(sweep, folder, layout)
        if outcome.path is not None or kind in NOT_THE_LAYOUTS or kind is None:
            return outcome
    return outcome


def _made_in(sweep: SweepState, folder: Path, layout: Layout) -> tuple[ReferenceOutcome, str | None]:
    """The reference made in ``layout`` (waiting for its GPUs, retrying faults that are not its own), and the failure
    kind of its last attempt (None: made, or the sweep stopped)."""
    attempts: dict[str, int] = {}
    outcome = ReferenceOutcome(None, layout, "equivalence gate off: the sweep was stopped before the reference")
    while not sweep.stop.is_set():
        slot, never = _reserved(sweep, layout, "the equivalence reference")
        if never is not None:
            return ReferenceOutcome(None, layout, f"equivalence gate off: the reference {layout.short()} can never "
                                    f"be placed: {never}"), "infra"
        if slot is None:
            break
        try:
            outcome, result = run_reference(sweep.cfg, sweep.handle, folder, layout, slot)
        finally:
            sweep.handle.release(slot)
        kind = result.failure_kind
        if outcome.path is not None or sweep.stop.is_set():
            return outcome, None
        if kind not in NOT_THE_LAYOUTS:
            return outcome, kind
        attempts[kind] = attempts.get(kind, 0) + 1
        if attempts[kind] >= MAX_ATTEMPTS[kind]:
            return outcome, kind
        console.print(f"[yellow]equivalence[/] the reference {layout.short()} failed for reasons not its layout's "
                      f"({kind}: {result.error}); it runs again (attempt {attempts[kind] + 1})", important=True)
    return outcome, None


def ensure_trajectory(sweep: SweepState, layout: Layout) -> None:
    """Before ``layout``'s confirmation: the reference layout's loss and gradient-norm trajectory over the
    confirmation's steps, on its global batch and micro-batches and in its precision, from the reference's weights
    (kept beside the reference, so ``--resume`` reuses it). Waited for and retried as the reference is; when it
    cannot be made the confirmation is not held against one (the console says why)."""
    key = trajectory_key(sweep.cfg, layout)
    if sweep.reference is None or sweep.options.rehearse or key in sweep.trajectories:
        return
    folder, steps = Path(sweep.reference), sweep.confirm_steps
    made = read_trajectory(trajectory_file(folder, key, steps))
    if made is None:
        made, why = _made_trajectory(sweep, folder, key, steps)
        if made is None:
            console.print(f"[yellow]trajectory[/] confirmations at global batch {key.gbs}, micro-batch {key.mbs}, "
                          f"{key.precision} are not held against the reference layout's trajectory: {why}",
                          important=True)
        else:
            console.print(f"[blue]trajectory[/] reference {made.layout} on global batch {key.gbs}: {steps} steps, loss "
                          f"{made.losses[0]:.4f} -> {made.losses[-1]:.4f}")
    sweep.trajectories[key] = made


def _made_trajectory(sweep: SweepState, folder: Path, key: TrajectoryKey,
                     steps: int) -> tuple[Trajectory | None, str]:
    written = written_layout(folder)
    layout = written and trajectory_layout(sweep.cfg, written, key)
    if not layout:
        return None, "the reference layout cannot run that batch in those micro-batches"
    attempts: dict[str, int] = {}
    while not sweep.stop.is_set():
        slot, never = _reserved(sweep, layout, "the reference trajectory")
        if never is not None:
            return None, f"its run {layout.short()} can never be placed: {never}"
        if slot is None:
            break
        try:
            made, result = run_trajectory(sweep.cfg, sweep.handle, folder, layout, steps, slot)
        finally:
            sweep.handle.release(slot)
        if made is not None:
            return made, ""
        kind = result.failure_kind or "infra"
        attempts[kind] = attempts.get(kind, 0) + 1
        if kind not in NOT_THE_LAYOUTS or attempts[kind] >= MAX_ATTEMPTS[kind]:
            return None, f"its run {layout.short()} failed ({kind}: {result.error})"
    return None, "the sweep was stopped"


def _reserved(sweep: SweepState, layout: Layout, what: str) -> tuple[Reservation | None, str | None]:
    """``layout``'s GPUs, waited for as a trial's are (the sweep's own runs ended and recorded meanwhile, else the
    capacity's idle wait): (the reservation, None); (None, why) when the capacity alive can never hold it; (None,
    None) when the sweep stopped."""
    while not sweep.stop.is_set():
        never = sweep.capacity.never(layout)
        if never is not None:
            return None, never
        slot = sweep.handle.reserve(layout)
        if slot is not None:
            return slot, None
        if sweep.scheduler.in_flight:
            sweep.wait_one()
        else:
            sweep.capacity.idle(what, layout)
    return None, None
