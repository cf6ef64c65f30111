"""rehearsal.json: what a rehearsed sweep (``search --rehearse``, trial.rehearsal) cost on its virtual clock, as a band
over the truth's level, and how many explored trials it needed to reach a layout within the run noise of the best
valid layout of the space, judged by the sweep's own objective and stability rule.

The band replays the sweep's runs with every step ``q / drawn`` times as long, for the level's quantiles q: each run
starts when the run whose end let it start ends (the driver launches when a trial ends), so the replay at the drawn
level is the sweep itself. A level moves every layout's step alike, so the sweep's proposals, its OOMs and its
trials-to-best are the same at every level; a run that the slower level makes longer than its timeout ends there,
as a timeout. What the replay cannot say: a sweep that ran its trials in another order (the per-layout errors decide
the order, and a band over them needs seeds of the whole rehearsal: ``--set search.seed=N``), nor one that a budget
(``search.wall_time_s``, ``search.gpu_hours``) would have stopped sooner or later at another level."""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.record.schema import TrialMetrics, TrialRecord, TrialResult
from sweeper.search.decide.objective import objective_value
from sweeper.search.decide.verdicts import is_stable
from sweeper.space.layout import Layout
from sweeper.trial.rehearsal import LEVEL_SIGMA, RUN_SIGMA, RehearsalHost, Run

# The band's quantiles of the level (log-normal, LEVEL_SIGMA): the standard normal's 10th, 50th and 90th percentiles.
QUANTILES = {"p10": -1.2815515655446004, "p50": 0.0, "p90": 1.2815515655446004}
# Why trials-to-best flatters the sweep, said where the figure is (issue 54).
OPTIMISTIC = ("optimistic: the modelled truth is the estimator's own step-time terms with drawn factors, so the "
              "sweep's opening proposals (the estimator's favourites) and its term-by-term refit fit it better than "
              "a real cluster, whose errors the model lacks terms for")


def replay(runs: list[Run], scale: float) -> tuple[float, float]:
    """The sweep's last end and its busy GPU-seconds with every step ``scale`` times as long (module docstring)."""
    order = sorted(range(len(runs)), key=lambda i: runs[i].start_s)
    ends_at = sorted((r.start_s + r.duration(), i) for i, r in enumerate(runs))
    end_times = [e for e, _ in ends_at]
    new_end: dict[int, float] = {}
    busy = 0.0
    for i in order:
        run = runs[i]
        k = bisect_right(end_times, run.start_s) - 1  # the latest run to end before this one started
        start = run.start_s
        if k >= 0 and ends_at[k][1] in new_end:
            before, j = ends_at[k]
            start = new_end[j] + (run.start_s - before)
        duration = run.duration(scale)
        new_end[i] = start + duration
        busy += duration * run.gpus
    return max(new_end.values(), default=0.0), busy


def band(host: RehearsalHost, total_gpus: int) -> dict[str, dict[str, float]]:
    """Wall time, busy and reserved GPU-hours at the level's quantiles, the sweep's runs replayed (``replay``); the
    driver's own waits after its last run ended (other jobs' GPUs) are kept as they were."""
    runs = list(host.ledger.log)
    last_end, _ = replay(runs, 1.0)
    tail = max(0.0, host.now() - last_end)
    out: dict[str, dict[str, float]] = {}
    for name, z in QUANTILES.items():
        end, busy = replay(runs, math.exp(z * LEVEL_SIGMA) / host.level)
        wall = end + tail
        out[name] = {"level": math.exp(z * LEVEL_SIGMA), "wall_time_h": wall / 3600, "busy_gpu_hours": busy / 3600,
                     "reserved_gpu_hours": total_gpus * wall / 3600}
    return out


def summary(host: RehearsalHost, records: list[TrialRecord], cfg: SweepConfig,
            launchable: list[Layout], valid: list[Layout]) -> dict[str, Any]:
    """rehearsal.json: what the rehearsed sweep cost on the virtual clock (this draw and the band), and how many
    explored trials it took to reach a layout within the run noise of the modelled best *valid* layout (the sweep's
    own pruning may have dropped it: that counts against the sweep)."""
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

    scored = [(v, lo) for lo in valid if (v := modelled(lo)) is not None]
    best, best_layout = max(scored, key=lambda p: p[0], default=(None, None))
    proposable = set(launchable)  # once: built per layout it took minutes on DeepSeek-V3's space (issue 54)
    launchable_best = max((v for v, lo in scored if lo in proposable), default=None)
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
    total_gpus = cfg.cluster.total_gpus
    return {
        "rehearsal": True,
        "note": "modelled trials on the virtual clock, never measured; see sweeper/trial/rehearsal.py",
        "cluster": {"nodes": cfg.cluster.nodes, "gpus_per_node": cfg.cluster.gpus_per_node},
        "faults": {"node_loss_per_hour": host.faults.node_loss_per_hour, "hang": host.faults.hang},
        "seed": host.seed, "modelled_level": host.level,
        "trials": len(explored), "runs": host.ledger.runs,
        "wall_time_h": wall / 3600,
        # GPU-hours two ways: the trials' own GPUs while they ran, and the whole cluster for the sweep's wall time
        # (what a reservation of the cluster costs).
        "busy_gpu_hours": host.ledger.gpu_s / 3600, "reserved_gpu_hours": total_gpus * wall / 3600,
        "band": {"over": f"the level's quantiles (log-normal, sigma {LEVEL_SIGMA}), the sweep's runs replayed",
                 **band(host, total_gpus)},
        "peak_concurrent_trials": host.ledger.peak_trials, "peak_disk_gib": host.ledger.peak_disk_bytes / 2**30,
        "keep_checkpoints": cfg.training.keep_checkpoints,
        "valid_layouts": len(valid), "launchable_layouts": len(launchable),
        "modelled_best_objective": best, "modelled_best_layout": best_layout.short() if best_layout else None,
        "modelled_best_launchable_objective": launchable_best,
        "trials_to_within_noise_of_best": reached,
        "trials_to_best_caveat": OPTIMISTIC + "; the same at every level of the band, this seed's draw of the "
                                              "per-layout errors only (other seeds: --set search.seed=N)",
    }
