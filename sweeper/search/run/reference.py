"""The equivalence reference: made once before the first trial, loaded (resharded) by every trial's gate
(``trial.reference``)."""

from __future__ import annotations

from sweeper.search.console import console
from sweeper.search.run.state import SweepState
from sweeper.trial.reference import ensure_reference


def make_reference(sweep: SweepState) -> None:
    outcome = ensure_reference(sweep.cfg, sweep.handle, sweep.dir.root / "reference")
    sweep.reference = outcome.path
    console.print(f"[blue]equivalence[/] {outcome.note}")
    if outcome.path is None:
        console.print("[yellow]equivalence[/] without the reference no trial proves it computes the model: "
                      + ("none can be stable (search.require_equivalence: false accepts them)"
                         if sweep.cfg.search.require_equivalence else
                         "search.require_equivalence is false, so passed trials may still be stable"),
                      important=True)
    meta = sweep.dir.read_meta()
    meta.reference = outcome.to_json()
    sweep.dir.write_meta(meta)
