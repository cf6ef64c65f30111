"""One-shot commands on the space's cluster: a single trial (`sweeper trial`) and the node check (`doctor`)."""

from __future__ import annotations

import time
from pathlib import Path

from sweeper.cluster.doctor import DoctorReport
from sweeper.config.schema import SweepConfig
from sweeper.plan.rules import check
from sweeper.record.schema import TrialResult
from sweeper.space.layout import Layout
from sweeper.trial.host import open_host
from sweeper.trial.protocol import reserved
from sweeper.trial.reference import ensure_reference

RESERVE_TIMEOUT_S = 60.0


def run_single_trial(cfg: SweepConfig, layout: Layout, out: Path | None, address: str | None) -> TrialResult:
    """Run one layout. A layout the rules reject is refused before anything starts (status pruned)."""
    reasons = check(cfg.model, layout, cfg.cluster, cfg.training.seq_length, cfg.run)
    if reasons:
        return TrialResult.pruned("; ".join(reasons))
    trial_dir = out or Path("sweeps") / cfg.name / "trials" / f"manual-{time.strftime('%Y%m%d-%H%M%S')}"
    with open_host(cfg, address) as host:
        reason = host.unsupported(cfg.model, layout)
        if reason is not None:
            return TrialResult(status="failed", failure_kind="unsupported", error=reason, backend=host.backend_name)
        reference = ensure_reference(cfg, host, Path("sweeps") / cfg.name / "reference")
        with reserved(host, layout, RESERVE_TIMEOUT_S) as slot:
            if slot is None:
                return TrialResult(status="failed", failure_kind="infra", backend=host.backend_name,
                                   error=f"the cluster has no free nodes for {layout.world_size} GPUs "
                                   f"({host.capacity_total()} GPUs alive)")
            result = host.run_trial(cfg, layout, trial_dir, reservation=slot, reference=reference.path)
        result.notes.append(reference.note)
        return result


def run_doctor(cfg: SweepConfig, address: str | None, trial_root: Path | None = None) -> DoctorReport:
    with open_host(cfg, address) as host:
        return host.doctor(cfg, trial_root)
