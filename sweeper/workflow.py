"""One-shot commands on the space's cluster: a single trial (`sweeper trial`) and the node check (`doctor`)."""

from __future__ import annotations

import time
from pathlib import Path

from sweeper.config import SweepConfig
from sweeper.layout import Layout
from sweeper.results import TrialResult
from sweeper.rules import check


def run_single_trial(cfg: SweepConfig, layout: Layout, out: Path | None, address: str | None) -> TrialResult:
    """Run one layout. A layout the rules reject is refused before anything starts (status pruned)."""
    reasons = check(cfg.model, layout, cfg.cluster, cfg.training.seq_length)
    if reasons:
        return TrialResult.pruned("; ".join(reasons))
    from sweeper.trial.host import open_host

    trial_dir = out or Path("sweeps") / cfg.name / "trials" / f"manual-{time.strftime('%Y%m%d-%H%M%S')}"
    with open_host(cfg, address) as host:
        reason = host.unsupported(cfg.model, layout)
        if reason is not None:
            result = TrialResult(status="failed", failure_kind="unsupported", error=reason, backend=host.backend_name)
            return result
        slot = None
        deadline = time.monotonic() + 60
        while slot is None and time.monotonic() < deadline:
            slot = host.reserve(layout)
            if slot is None:
                time.sleep(1.0)  # nodes of a freshly started cluster may still be registering
        if slot is None:
            return TrialResult(status="failed", failure_kind="infra", backend=host.backend_name,
                               error=f"the cluster has no free nodes for {layout.world_size} GPUs "
                               f"({host.capacity_total()} GPUs alive)")
        from sweeper.reference import ensure_reference

        host.release(slot)  # the reference runs first, on whatever it needs
        reference = ensure_reference(cfg, host, Path("sweeps") / cfg.name / "reference")
        slot = host.reserve(layout)
        if slot is None:
            return TrialResult(status="failed", failure_kind="infra", backend=host.backend_name,
                               error="the trial's GPUs were taken while the reference ran")
        result = host.run_trial(cfg, layout, trial_dir, reservation=slot, reference=reference.path)
        result.notes.append(reference.note)
        return result


def run_doctor(cfg: SweepConfig, address: str | None):  # noqa: ANN201 - DoctorReport lives behind the Ray import
    from sweeper.trial.host import open_host

    with open_host(cfg, address) as host:
        return host.doctor(cfg)
