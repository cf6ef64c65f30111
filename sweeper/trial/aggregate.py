"""From per-rank outcomes to one TrialResult: root cause, metrics, checks (pure; no Ray, no torch).

A multi-rank failure is a cascade: rank 3 runs out of memory, its peers then fail in a collective (comm_error) or
are killed by the trial timeout. The result must name the first *real* failure, so outcomes are ranked by how
much they explain: a rank's own failure (oom, nan, invalid_layout, checkpoint_error, ...) over a rank that died
(infra) over collateral communication errors over timeouts; ties go to the earliest arrival.

Metrics follow the contract: the step time is the mean over post-warm-up steps of the slowest rank's time for that
step (a step ends when the last rank ends it; the mean, because a run pays every stall), with the median, 90th
percentile and slowest step beside it; tokens/s and TFLOP/s per GPU derive from the mean; peak memory is
the maximum over ranks, and so is each smoke-run phase's time (``timings_s``) and the checkpoint's save and load
time. A node's ranks save at once, so the host memory a save needs is, per node, the sum of its ranks' peak
resident sets during the save; a trial whose save held more than a node's host memory fails as
``checkpoint_host_oom`` (issue 17).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Any

from sweeper.backends.base import RankReport
from sweeper.config.units import GIB
from sweeper.record.schema import FAILURE_KINDS, TrialChecks, TrialMetrics, TrialResult
from sweeper.space.layout import Layout

# A trial's note when its root cause is one of its own ranks failing as ``infra``: the rank's process died (a
# segfault in a kernel, a CUDA illegal memory access, the host's memory monitor) or raised an error that is neither
# Megatron's nor a known environment fault. Not the note of a trial stopped before its ranks ran (placement, ranks
# that could not start, cancellation). Whether the layout caused it is decided over attempts
# (``search.decide.verdicts.attribute``): once its node is known alive, the second time is the layout's.
RANK_FAULT = "rank_fault"
NODE_LOST = "node_lost"  # a note: one of the trial's nodes was lost while it ran (the runner's)

# Lower explains more. Kinds not listed (a rank's own failure) rank 0.
_COLLATERAL_RANK = {"infra": 1, "comm_error": 2, "timeout": 3}


@dataclass
class RankOutcome:
    """What the driver learnt about one rank: its report, or how it died, or nothing (killed when aborting)."""

    rank: int
    node: str  # short node label
    report: RankReport | None = None
    died: str | None = None  # the rank's process, its actor or its node died: the reason, one line
    actor_lost: bool = False  # the rank's Ray actor itself is gone (not only a warm rank's forked child)
    arrived: float = float("inf")  # driver clock when the outcome arrived (orders the cascade)
    # A rank stopped before it reported: the checks it had proven by then, as the backend shared them.
    proven: TrialChecks | None = None

    @property
    def failure_kind(self) -> str | None:
        if self.died is not None:
            return "infra"
        if self.report is not None and not self.report.ok:
            kind = self.report.failure_kind
            return kind if kind in FAILURE_KINDS else "infra"
        return None

    @property
    def failed(self) -> bool:
        return self.failure_kind is not None


def is_collateral(kind: str | None) -> bool:
    """Whether a failure kind is usually a consequence of another rank's failure (keep looking for the cause)."""
    return kind in _COLLATERAL_RANK


def root_cause(outcomes: list[RankOutcome]) -> RankOutcome | None:
    failed = [o for o in outcomes if o.failed]
    if not failed:
        return None
    return min(failed, key=lambda o: (_COLLATERAL_RANK.get(o.failure_kind or "", 0), o.arrived, o.rank))


def describe(outcome: RankOutcome) -> str:
    """One line naming the rank, its node and what went wrong."""
    where = f"rank {outcome.rank} ({outcome.node})"
    if outcome.died is not None:
        return f"{where}: {outcome.died}"
    report = outcome.report
    assert report is not None
    return f"{where}: {report.error or report.failure_kind or 'failed without a message'}"


def aggregate(
    outcomes: list[RankOutcome],
    *,
    world_size: int,
    warmup_steps: int,
    trial_dir: str | None,
    timeout_error: str | None = None,
    abort_error: tuple[str, str] | None = None,
    notes: list[str] | None = None,
) -> TrialResult:
    """Fold rank outcomes into the contract's TrialResult.

    ``timeout_error``: the trial hit its wall-time limit (failure kind timeout unless a rank already failed for
    a real reason). ``abort_error``: (kind, message) for a trial stopped by the driver before any rank could fail
    (placement timeout, cancellation, rank actors that never started).
    """
    reports = [o.report for o in sorted(outcomes, key=lambda o: o.rank) if o.report is not None]
    cause = root_cause(outcomes)
    all_notes = list(notes or [])
    for report in reports:
        all_notes += [n for n in report.notes if n not in all_notes]

    status: str = "passed"
    kind: str | None = None
    error: str | None = None
    # A hung trial's peers may report comm errors; the hang (timeout) explains them, a dead rank does not.
    if cause is not None and not (timeout_error and cause.failure_kind in ("comm_error", "timeout")):
        status, kind, error = "failed", cause.failure_kind, describe(cause)
        if kind == "infra" and RANK_FAULT not in all_notes:
            all_notes.append(RANK_FAULT)
    elif timeout_error:
        status, kind, error = "failed", "timeout", timeout_error
    elif abort_error is not None:
        status, (kind, error) = "failed", abort_error
    elif len(reports) < world_size:
        missing = sorted(set(range(world_size)) - {r.rank for r in reports})
        status, kind, error = "failed", "infra", f"no report from ranks {missing}"
    held, over = checkpoint_host_memory(outcomes)
    if status == "passed" and over is not None:
        status, kind, error = "failed", "checkpoint_host_oom", over

    memory_kinds = {r.memory_kind for r in reports}
    metrics = _metrics(reports, world_size, warmup_steps, held)
    stress = _routing_stress(reports)
    if stress:
        metrics.stress_peak_memory_gib = max(mode["peak_memory_gib"] for mode in stress.values())
    return TrialResult(
        status=status,  # type: ignore[arg-type]
        failure_kind=kind,  # type: ignore[arg-type]
        error=error,
        metrics=metrics,
        checks=_checks(outcomes, world_size),
        checkpoint=_checkpoint(reports, world_size),
        rank_nodes=[o.node for o in sorted(outcomes, key=lambda o: o.rank)],
        backend=reports[0].backend if reports else "none",
        memory_kind=("device" if "device" in memory_kinds else "host") if reports else None,
        losses=_losses(reports),
        grad_norms=_grad_norms(reports),
        notes=all_notes,
        trial_dir=trial_dir,
        timings_s=_timings(reports),
        step_times_s=_step_times(reports),
        rank_peak_memory_gib=[r.peak_memory_bytes / GIB if r.peak_memory_bytes else None for r in reports],
        placement=(placement := _placement(reports, {o.rank: o.node for o in outcomes})),
        placement_warnings=_spanning(placement),
        reference_load=_reference_load(reports),
        routing_stress=stress,
        # Rank 0 measures (and deletes) the trial's one checkpoint folder (backends/megatron/smoke.py).
        checkpoint_bytes=next((r.checkpoint_bytes for r in reports if r.checkpoint_bytes is not None), None),
        checkpoint_deleted=any(r.checkpoint_deleted for r in reports),
    )


def _routing_stress(reports: list[RankReport]) -> dict[str, dict[str, Any]] | None:
    """Each stress mode over the ranks: the highest peak, the hot-rank factor, finite everywhere."""
    stressed = [r.routing_stress for r in reports if r.routing_stress]
    if not stressed:
        return None
    out: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(m for s in stressed for m in s):
        runs = [s[mode] for s in stressed if mode in s]
        factors = [x["hot_rank_factor"] for x in runs if x.get("hot_rank_factor") is not None]
        out[mode] = {"peak_memory_gib": max(x["peak_memory_bytes"] for x in runs) / GIB,
                     "hot_rank_factor": max(factors) if factors else None,
                     "finite": all(x["finite"] for x in runs)}
    return out


def _reference_load(reports: list[RankReport]) -> dict[str, Any] | None:
    """Every rank's load of the reference checkpoint, as one record: the union of the tensors (and of the
    resharded ones) over ranks, each rank's load time."""
    loads = [r.reference_load for r in reports if r.reference_load]
    if not loads:
        return None
    return {
        "from_layout": Layout.from_dict(loads[0]["layout"]).short(),
        "tensors": len({k for load in loads for k in load["tensors"]}),
        "resharded": sorted({k for load in loads for k in load["resharded"]}),
        "load_s": [r.reference_load["load_s"] if r.reference_load else None for r in reports],
    }


# Groups whose traffic is on every layer's critical path: across nodes they run at the inter-node bandwidth
# (docs/LAYOUT_RULES.md), which is why placement keeps them on one node.
NODE_LOCAL_GROUPS = ("tp", "etp")


def _placement(reports: list[RankReport], nodes: dict[int, str]) -> dict[str, list[list[dict[str, Any]]]]:
    """Kind -> each distinct group (as the ranks reported it) -> its members with their node and GPU."""
    gpus = {r.rank: r.gpu for r in reports}
    out: dict[str, list[list[dict[str, Any]]]] = {}
    for kind in dict.fromkeys(k for r in reports for k in r.groups):
        groups = sorted({tuple(r.groups[kind]) for r in reports if kind in r.groups})
        out[kind] = [[{"rank": m, "node": nodes.get(m, "?"), "gpu": gpus.get(m)} for m in g] for g in groups]
    return out


def _spanning(placement: dict[str, list[list[dict[str, Any]]]]) -> list[str]:
    """One line per TP or ETP group whose ranks ran on more than one node."""
    out = []
    for kind in NODE_LOCAL_GROUPS:
        for group in placement.get(kind, []):
            nodes = sorted({m["node"] for m in group})
            if len(nodes) > 1:
                ranks = [m["rank"] for m in group]
                out.append(f"{kind.upper()} group {ranks} spans nodes {', '.join(nodes)}")
    return out


def _step_times(reports: list[RankReport]) -> list[float]:
    """Each step's time: ranks time the same steps, and the slowest rank bounds each step."""
    timed = [r.step_times_s for r in reports if r.step_times_s]
    return [max(t[i] for t in timed) for i in range(min(len(t) for t in timed))] if timed else []


def checkpoint_host_memory(outcomes: list[RankOutcome]) -> tuple[float | None, str | None]:
    """The most host memory one node held while its ranks saved the checkpoint (GiB: the sum of their peak
    resident sets during the save, which run at once), and one line when that exceeds the node's host memory."""
    by_node: dict[str, list[RankReport]] = {}
    for o in sorted(outcomes, key=lambda o: o.rank):
        if o.report is not None and o.report.checkpoint_save_rss_bytes:
            by_node.setdefault(o.node, []).append(o.report)
    worst: float | None = None
    over: str | None = None
    for node, reports in by_node.items():
        held = sum(r.checkpoint_save_rss_bytes or 0 for r in reports)
        worst = max(worst or 0.0, held / GIB)
        limit = min((r.host_memory_bytes for r in reports if r.host_memory_bytes), default=None)
        if limit is not None and held > limit and over is None:
            ranks = ",".join(str(r.rank) for r in reports)
            over = (f"checkpoint save held {held / GIB:.2f} GiB of host memory on node {node} (ranks {ranks}, "
                    f"peak resident memory during the save, summed), more than the node's {limit / GIB:.2f} GiB")
    return worst, over


def _metrics(reports: list[RankReport], world_size: int, warmup_steps: int,
             checkpoint_host_gib: float | None = None) -> TrialMetrics:
    metrics = TrialMetrics(checkpoint_save_host_gib=checkpoint_host_gib)
    saves = [r.checkpoint_save_s for r in reports if r.checkpoint_save_s is not None]
    loads = [r.checkpoint_load_s for r in reports if r.checkpoint_load_s is not None]
    metrics.checkpoint_save_s = max(saves) if saves else None  # ranks leave the save together: the slowest
    metrics.checkpoint_load_s = max(loads) if loads else None
    per_step = _step_times(reports)
    if per_step:
        # Warm-up steps are excluded when any remain. Throughput is over the mean step: a run pays every stall.
        timed = per_step[warmup_steps:] if len(per_step) > warmup_steps else per_step
        metrics.step_time_s = statistics.fmean(timed)
        metrics.step_time_median_s = statistics.median(timed)
        metrics.step_time_p90_s = percentile(timed, 0.9)
        metrics.step_time_max_s = max(timed)
    tokens = max((r.tokens_per_step for r in reports), default=0)
    flops = max((r.flops_per_step for r in reports), default=0.0)
    if metrics.step_time_s and metrics.step_time_s > 0:
        if tokens:
            metrics.tokens_per_s = tokens / metrics.step_time_s
        if flops:
            metrics.tflops_per_gpu = flops / metrics.step_time_s / 1e12 / world_size
    peaks = [r.peak_memory_bytes for r in reports if r.peak_memory_bytes]
    if peaks:
        metrics.peak_memory_gib = max(peaks) / GIB
    for name in ("non_torch_memory", "checkpoint_peak_memory", "pre_steps_peak_memory"):
        values = [getattr(r, f"{name}_bytes") for r in reports if getattr(r, f"{name}_bytes") is not None]
        if values:
            setattr(metrics, f"{name}_gib", max(values) / GIB)
    losses = _losses(reports)
    if losses:
        metrics.loss_first, metrics.loss_last = losses[0], losses[-1]
    factors = [r.moe_hot_rank_factor for r in reports if r.moe_hot_rank_factor is not None]
    if factors:
        metrics.moe_hot_rank_factor = max(factors)
    return metrics


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolated between the nearest ranks (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _timings(reports: list[RankReport]) -> dict[str, float]:
    # Ranks leave a phase together at its closing collective, so the slowest rank's time is the phase's time.
    phases = dict.fromkeys(k for r in reports for k in r.timings_s)
    return {k: max(r.timings_s[k] for r in reports if k in r.timings_s) for k in phases}


def _losses(reports: list[RankReport]) -> list[float]:
    # Only last-pipeline-stage ranks compute the loss; they agree with each other, so the first one with a
    # loss history is the trial's.
    return next((list(r.losses) for r in reports if r.losses), [])


def _grad_norms(reports: list[RankReport]) -> list[float]:
    # Megatron's optimizer reduces the norm over every model-parallel group, so every rank reports the same one.
    return next((list(r.grad_norms) for r in reports if r.grad_norms), [])


def _checks(outcomes: list[RankOutcome], world_size: int) -> TrialChecks:
    """A check holds when every rank proved it: from its report, or from what it had shared before it was
    stopped (a rank that died or never answered proved nothing)."""
    checks = TrialChecks()
    known = [o.report.checks if o.report is not None else o.proven for o in outcomes]
    proven = [c for c in known if c is not None]
    complete = len(proven) == world_size
    for f in fields(TrialChecks):
        values = [getattr(c, f.name) for c in proven]
        if f.name in ("checkpoint_reloaded", "replicas_consistent"):
            attempted = [v for v in values if v is not None]
            value: object = (all(attempted) and complete) if attempted else None
        elif f.name == "equivalence_rel_err":
            errs = [float(v) for v in values if v is not None]
            value = max(errs) if errs else None
        else:
            value = complete and all(bool(v) for v in values)
        setattr(checks, f.name, value)
    return checks


def _checkpoint(reports: list[RankReport], world_size: int) -> str | None:
    if len(reports) < world_size or not all(r.checks.checkpoint_saved for r in reports):
        return None
    return next((r.checkpoint_dir for r in reports if r.checkpoint_dir), None)


def classify_exception(exc: BaseException) -> str:
    """Failure kind of an exception that escaped a backend (which should never raise; this is the safety net)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"OutOfMemoryError", "MemoryError"}:
        return "oom"
    if names & {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError"}:
        return "comm_error"
    return "infra"
