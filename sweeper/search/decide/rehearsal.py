"""rehearsal.json: what a rehearsed sweep (``search --rehearse``, trial.rehearsal) cost on its virtual clock, and how
many explored trials it needed to reach a layout within the run noise of the modelled best, judged by the sweep's own
objective and stability rule."""

from __future__ import annotations

import math
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.record.schema import TrialMetrics, TrialRecord, TrialResult
from sweeper.search.decide.objective import objective_value
from sweeper.search.decide.verdicts import is_stable
from sweeper.space.layout import Layout
from sweeper.trial.rehearsal import RUN_SIGMA, RehearsalHost


def summary(host: RehearsalHost, records: list[TrialRecord], cfg: SweepConfig,
            launchable: list[Layout]) -> dict[str, Any]:
    """rehearsal.json: what the rehearsed sweep cost on the virtual clock, and how many explored trials it took to
    reach a layout within the run noise of the modelled best launchable layout."""
    def modelled(layout: Layout) -> float | None:
        truth = host.truth(layout)
        if truth is None or truth.peak_memory_gib > cfg.cluster.gpu_memory_gib:
            return None
        result = TrialResult(status="passed", metrics=TrialMetrics(
            tokens_per_s=truth.tokens_per_s, step_time_s=truth.step_time_s, tflops_per_gpu=truth.tflops_per_gpu,
            peak_memory_gib=truth.peak_memory_gib))
        if not is_stable(result, cfg):
            return None
        return objective_value(result, cfg, layout)

    values = [v for v in map(modelled, launchable) if v is not None]
    best = max(values, default=None)
    explored = [r for r in records if r.phase == "explore" and r.attempt >= 1]
    reached = None
    if best is not None:
        target = best * math.exp(-2 * RUN_SIGMA)
        for i, record in enumerate(explored, 1):
            value = modelled(Layout.from_dict(record.layout))
            if value is not None and value >= target:
                reached = i
                break
    wall = host.now()
    return {
        "rehearsal": True,
        "note": "modelled trials on the virtual clock, never measured; see sweeper/trial/rehearsal.py",
        "cluster": {"nodes": cfg.cluster.nodes, "gpus_per_node": cfg.cluster.gpus_per_node},
        "faults": {"node_loss_per_hour": host.faults.node_loss_per_hour, "hang": host.faults.hang},
        "seed": host.seed, "modelled_level": host.level,
        "trials": len(explored), "runs": host.ledger.runs,
        "wall_time_h": wall / 3600, "gpu_hours": host.ledger.gpu_s / 3600,
        "peak_concurrent_trials": host.ledger.peak_trials, "peak_disk_gib": host.ledger.peak_disk_bytes / 2**30,
        "launchable_layouts": len(launchable), "modelled_best_objective": best,
        "trials_to_within_noise_of_best": reached,
    }
