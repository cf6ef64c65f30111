"""`sweeper replan`: a finished sweep re-ranked for a production run of another size (issue 54).

The sweep measured layouts of W GPUs and ranked each as the production run of N GPUs runs it (``objective``).
At another N' the same measurements say most of what changes: the production layout's data parallelism is
``N' // W`` copies' (the DP and EDP gradient reduce over more or fewer ranks, the distributed optimizer's shard), and
the production's global batch stays ``training.global_batch_size``, so each data-parallel rank runs
``global batch / (DP x MBS)`` micro-batches (the pipeline bubble's share grows as they fall). A measured layout's
production step at N' is its step at N, exactly as the sweep's decision projected it, plus what the sweep's
calibrated estimator prices the production layout at N' over the one at N (``_moved``); at N' = N nothing moves
and the sweep's own figures and winner come back. The layouts the sweep never measured are the space's valid
layouts at N', predicted through one term table of their production layouts (``estimate.term_table``) under the
sweep's calibration.

Nothing is written into the sweep folder: the replan is printed (a table, or ``--json``) and, when asked, written
to a file of the user's choosing (``--out``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from sweeper.config.load import load_config, proxy_config
from sweeper.config.schema import BudgetConfig, SweepConfig
from sweeper.errors import LayoutError, UsageError
from sweeper.estimate import Estimate, Estimator
from sweeper.estimate.calibration import Calibration, load
from sweeper.estimate.calibrator import key
from sweeper.estimate.term_table import TermTable, without_cycle_collection
from sweeper.models.proxy import PROXY_SUFFIX
from sweeper.plan.assess import assess, judge
from sweeper.plan.rules import Checker
from sweeper.plan.space import enumerate_layouts
from sweeper.record.schema import MODELLED, SweepMeta, TrialRecord, is_rehearsal
from sweeper.record.sweepdir import SweepDir
from sweeper.search.decide.candidates import Candidate, candidates
from sweeper.search.decide.decision import SECONDS_PER_DAY, measured_layout, production, throughput
from sweeper.search.decide.objective import PROJECTED_STEP_ERROR, copies, objective_value, projection
from sweeper.search.decide.verdicts import is_stable
from sweeper.space.layout import Layout

# How the outputs name the step-time terms that move with the production run's size.
TERM_NAMES = {
    "dp": "data-parallel gradient reduce",
    "edp": "expert data-parallel gradient reduce",
    "pp_bubble": "pipeline bubble",
    "pp_p2p": "pipeline point-to-point",
    "optimizer": "optimizer step (distributed optimizer shard)",
}
# A term is named as moved when it changed by at least this share of the step at N.
MOVED_SHARE = 0.005
TOP = 10


@dataclass(frozen=True)
class SweepFolder:
    """What a finished sweep folder holds that the replan reads: its config (space.yaml with the sweep's ``--set``
    items), its records, sweep.json and the calibration its decision priced the production run with."""

    root: Path
    cfg: SweepConfig
    records: list[TrialRecord]
    meta: SweepMeta
    calibration: Calibration | None
    rehearsal: bool


def open_sweep(root: Path, overrides: Sequence[str] = ()) -> SweepFolder:
    """The finished sweep in ``root``; ``overrides``: ``budget.*`` items of ``--set`` applied over its YAML. Bad
    input (no such folder, not a sweep folder, a sweep that did not finish, another section set) is a UsageError."""
    if not root.is_dir():
        raise UsageError(f"{root}: no such folder")
    folder = SweepDir(root)
    if not folder.meta.is_file() or not folder.trials.is_file():
        raise UsageError(f"{root}: not a sweep folder (no sweep.json and trials.jsonl)")
    meta = folder.read_meta()
    if meta.status != "finished":
        raise UsageError(f"{root}: not a finished sweep (sweep.json status {meta.status}): `sweeper search --resume "
                         "--out DIR` finishes it")
    if not folder.space.is_file():
        raise UsageError(f"{root}: no space.yaml (the search YAML the sweep started with)")
    for item in overrides:
        name = item.partition("=")[0].strip()
        if not name.startswith("budget."):
            raise UsageError(f"--set {item}: replan changes only budget.* (the production run); the measured trials "
                             "ran the sweep's model, cluster and training")
    cfg = load_config(folder.space, overrides=[*folder.space_overrides(), *overrides])
    if (meta.name or "").endswith(PROXY_SUFFIX) and not cfg.name.endswith(PROXY_SUFFIX):
        cfg = proxy_config(cfg)  # the sweep ran with --proxy
    records = folder.read_trials()
    return SweepFolder(root, cfg, records, meta, sweep_calibration(root, cfg, records, meta),
                       bool(is_rehearsal(meta, records)))


def sweep_calibration(root: Path, cfg: SweepConfig, records: list[TrialRecord],
                      meta: SweepMeta) -> Calibration | None:
    """The calibration the sweep's decision priced with (its Calibrator's last): the cluster's factors it stored in
    its folder (``calibration.json``, under the cluster and model's key); none on a simulated sweep, whose factors
    are its CPU's; the MoE hot-rank factor its trials measured, on any backend."""
    calibration = None
    if meta.memory_kind != "host":
        try:
            calibration = load(root / "calibration.json", key(cfg))
        except (OSError, ValueError, TypeError):
            calibration = None
    hot = max((r.result.metrics.moe_hot_rank_factor or 0.0 for r in records), default=0.0)
    if hot > ((calibration and calibration.moe_hot_rank_factor) or 1.0):
        calibration = replace(calibration or Calibration(), moe_hot_rank_factor=hot)
    return calibration


def at_gpus(cfg: SweepConfig, gpus: int) -> SweepConfig:
    """``cfg`` with a production run of ``gpus`` GPUs (``budget.gpus``)."""
    if cfg.budget is not None:
        return cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"gpus": gpus})})
    # Only budget.gpus is read from it (SweepConfig.production_gpus); the days come from the sweep's own budget.
    return cfg.model_copy(update={"budget": BudgetConfig.model_construct(tokens=1.0, gpu_hour_usd=None, gpus=gpus)})


@dataclass
class Row:
    """One layout as the production run of N' GPUs runs it."""

    layout: Layout  # the production layout at N'
    trial: Layout  # the layout a trial runs (gbs x W / N')
    kind: str  # measured | modelled | predicted | predicted (calibrated)
    tokens_per_s: float
    low: float
    high: float
    step_time_s: float
    predicted: Estimate  # the production layout at N', under the sweep's calibration
    number: int | None = None  # the sweep's trial
    confirmed: bool | None = None
    confirmations: int = 0  # the sweep's confirmation runs of it that said something about the layout
    objective: float | None = None  # measured: the median of its runs' objectives at N' (what the choice ranks)
    before: dict[str, Any] | None = None  # at the sweep's N: layout, tokens_per_s, step_time_s, microbatches
    moved_s: dict[str, float] = field(default_factory=dict)  # term -> seconds per step at N' minus at N
    memory_before_gib: float | None = None
    days: float | None = None
    notes: list[str] = field(default_factory=list)
    needs_trial: str | None = None

    @property
    def microbatches(self) -> int:
        return microbatches(self.layout)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layout": self.layout.short(), "trial_layout": self.trial.to_string(), "number": self.number,
            "gpus": self.trial.world_size, "copies": self.layout.world_size // self.trial.world_size,
            "kind": self.kind, "confirmed": self.confirmed, "confirmations": self.confirmations,
            "tokens_per_s": self.tokens_per_s, "low": self.low,
            "high": self.high, "step_time_s": self.step_time_s, "objective": self.objective,
            "microbatches": self.microbatches, "memory_gib": round(self.predicted.memory_gib, 3),
            "fits": self.predicted.fits, "days": self.days, "before": self.before,
            "moved_step_time_s": {k: round(v, 6) for k, v in self.moved_s.items()},
            "memory_before_gib": None if self.memory_before_gib is None else round(self.memory_before_gib, 3),
            "notes": self.notes, "needs_trial": self.needs_trial,
        }
        return out


@dataclass
class Replan:
    gpus: int
    original_gpus: int
    folder: SweepFolder
    rows: list[Row]  # best first: the measured ones valid at N' and the best predicted ones
    winner: Row | None  # the measured layout the sweep's choice would take at N'
    original: Row | None  # the sweep's winner at N' (None: it cannot run there)
    original_number: int | None
    original_layout: str | None
    refused: list[dict[str, Any]]  # measured layouts that cannot run at N', with the reason
    unmeasured: dict[str, int]
    why: str
    seconds: float = 0.0

    @property
    def winner_changed(self) -> bool:
        return self.winner is None or self.winner.number != self.original_number

    @property
    def needs_trial(self) -> list[dict[str, str]]:
        return [{"layout": r.trial.to_string(), "reason": r.needs_trial} for r in self.rows if r.needs_trial]

    def to_json(self) -> dict[str, Any]:
        cfg = self.folder.cfg
        return {
            "sweep": str(self.folder.root), "rehearsal": self.folder.rehearsal, "gpus": self.gpus,
            "original_gpus": self.original_gpus, "global_batch_size": cfg.training.global_batch_size,
            "objective": cfg.search.objective, "calibration": calibration_line(self.folder),
            "budget": None if cfg.budget is None else cfg.budget.model_dump(),
            "original_winner": {"number": self.original_number, "layout": self.original_layout,
                                "at_gpus": None if self.original is None else self.original.to_json()},
            "winner": None if self.winner is None else self.winner.to_json(),
            "winner_changed": self.winner_changed, "why": self.why, "needs_trial": self.needs_trial,
            "layouts": [r.to_json() for r in self.rows], "refused": self.refused, "unmeasured": self.unmeasured,
            "seconds": round(self.seconds, 3),
        }


def calibration_line(folder: SweepFolder) -> str:
    cal = folder.calibration
    if cal is None or not (cal.samples or cal.step_term_factors):
        extra = " but for the MoE hot-rank factor its trials measured" if cal is not None else ""
        why = " (a simulated sweep: its factors are its CPU's)" if folder.meta.memory_kind == "host" else ""
        return f"uncalibrated{extra}{why}, as the sweep's decision"
    return f"the sweep's calibration ({cal.samples} {'modelled' if folder.rehearsal else 'measured'} trials)"


def microbatches(layout: Layout) -> int:
    """Micro-batches each data-parallel rank runs per step: global batch / (DP x MBS)."""
    return layout.gbs // max(1, layout.dp * layout.mbs)


def _moved(step_s: float, delta_s: float, before: Estimate, after: Estimate) -> float:
    """A step of ``step_s`` moved by the estimator's ``delta_s``; scaled instead where a measured step shorter than
    the prediction would be driven to nothing (a much faster cluster than priced: the share moves, not seconds)."""
    moved = step_s + delta_s
    if moved > 0.1 * step_s or not before.step_time_s or not after.step_time_s:
        return moved
    return step_s * after.step_time_s / before.step_time_s


def _terms_moved(before: Estimate, after: Estimate) -> dict[str, float]:
    """The step-time terms that changed by at least ``MOVED_SHARE`` of the step, largest change first."""
    old, new = before.step_time_terms_s, after.step_time_terms_s
    floor = MOVED_SHARE * (before.step_time_s or 0.0)
    moved = {t: new.get(t, 0.0) - old.get(t, 0.0) for t in {*old, *new}}
    return dict(sorted(((t, d) for t, d in moved.items() if abs(d) >= floor and d), key=lambda kv: -abs(kv[1])))


def term_name(term: str) -> str:
    if term.startswith("compute."):
        return f"{term} (per-rank compute: fewer or more micro-batches)"
    return TERM_NAMES.get(term, term)


def replan(folder: SweepFolder, gpus: int, top: int = TOP) -> Replan:
    """The sweep re-ranked for a production run of ``gpus`` GPUs."""
    started = time.perf_counter()
    cfg = folder.cfg
    sizes = cfg.world_sizes
    if gpus < 1:
        raise UsageError(f"--gpus: must be a positive integer, got {gpus}")
    if not any(gpus % w == 0 for w in sizes):
        raise UsageError(f"--gpus {gpus}: not a multiple of any of the sweep's layout sizes (space.gpus: {sizes})")
    new = at_gpus(cfg, gpus)
    estimator = Estimator.for_config(cfg, folder.calibration)
    checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length, cfg.run)
    memo: dict[Layout, Estimate] = {}

    def predict(layout: Layout) -> Estimate:
        if layout not in memo:
            memo[layout] = estimator(layout)
        return memo[layout]

    cands = candidates(folder.records, cfg, folder.calibration)
    measured: list[Row] = []
    refused: list[dict[str, Any]] = []
    for cand in cands:
        row, reason = _measured_row(folder, new, cand, checker, predict)
        if row is None:
            refused.append({"number": cand.number, "layout": cand.layout.to_string(), "gpus": cand.layout.world_size,
                            "reason": reason})
        else:
            measured.append(row)
    # one row per production layout at N': the trial of the largest W (the one whose step was the most measured)
    kept: dict[Layout, Row] = {}
    for row in sorted(measured, key=lambda r: (-r.trial.world_size, r.number or 0)):
        kept.setdefault(row.layout, row)
    measured = list(kept.values())
    winner = _choose(measured, cfg)
    predicted, unmeasured = _predicted_rows(folder, new, set(kept), predict, top)
    if not measured and not predicted:
        reason = str(refused[0]["reason"]) if refused else "no layout of the space is valid there"
        raise UsageError(f"--gpus {gpus}: no layout of the sweep can run on {gpus} GPUs ({reason})")
    rows = sorted([*measured, *predicted], key=lambda r: -r.tokens_per_s)  # every measured one, the best predicted
    budget_tokens = cfg.budget.tokens if cfg.budget is not None else None
    lead = winner.tokens_per_s if winner is not None else None
    for row in rows:
        if budget_tokens and row.tokens_per_s > 0:
            row.days = budget_tokens / row.tokens_per_s / SECONDS_PER_DAY
        if row.number is None and lead is not None and row.tokens_per_s > lead:
            gain = row.tokens_per_s / lead - 1
            row.needs_trial = (f"never measured: predicted {gain:+.0%} over the measured winner at {gpus} GPUs (the "
                               f"estimator's step-time error is about {PROJECTED_STEP_ERROR:.0%})")
        elif row.number is None and lead is None:
            row.needs_trial = "never measured: no measured layout runs at this size"
        elif row.number is not None and not row.confirmations and lead is not None and row.tokens_per_s > lead:
            row.needs_trial = (f"never confirmed: {row.tokens_per_s / lead - 1:+.0%} over the choice at {gpus} GPUs "
                               "on one measured run")
    if winner is not None and not winner.confirmed:
        winner.needs_trial = "never confirmed: the choice only because no confirmed layout runs at this size"
    best = (folder.meta.best or {})
    original_number = best.get("number") if isinstance(best.get("number"), int) else None
    original = next((r for r in measured if r.number == original_number), None)
    plan = Replan(gpus, cfg.production_gpus, folder, rows, winner, original, original_number,
                  best.get("layout") if isinstance(best.get("layout"), str) else None, refused, unmeasured, "")
    plan.why = _why(plan)
    plan.seconds = time.perf_counter() - started
    return plan


def _measured_row(folder: SweepFolder, new: SweepConfig, cand: Candidate, checker: Checker,
                  predict: Any) -> tuple[Row | None, str]:
    """A stable candidate of the sweep at N' (None and the reason where its layout cannot run there)."""
    cfg, cal = folder.cfg, folder.calibration
    w = cand.layout.world_size
    trial = replace(cand.layout, gbs=new.trial_global_batch(w))
    reasons = assess(new, trial, checker=checker, predict=False).reasons
    if reasons:
        return None, reasons[0]
    layout = new.production_layout(trial)
    assert layout is not None
    base = cfg.production_layout(cand.layout) or cand.layout  # what the sweep's figure at N is the step of
    try:
        before, after = predict(base), predict(layout)
    except (LayoutError, ValueError) as exc:
        return None, f"the estimator cannot price it: {exc}"
    delta = (after.step_time_s or 0.0) - (before.step_time_s or 0.0)
    rate = throughput(cfg, cand, predict(cand.layout), cal, folder.rehearsal)
    if copies(cfg, cand.layout):
        made = production(cfg, measured_layout(cand), rate, cal)  # its run at scale's, where it has one
        base_step = made.get("step_time_s") or rate["step_time_s"]
        base_rates = (made["tokens_per_s"], made["low"], made["high"])
    else:  # larger than the sweep's production run: its own figures, its global batch the production's
        base_step = rate["step_time_s"]
        scale = cfg.training.global_batch_size / cand.layout.gbs
        base_rates = (rate["median"] * scale, rate["low"] * scale, rate["high"] * scale)
    if not base_step:
        return None, "no step time was measured"
    step = _moved(base_step, delta, before, after)
    tokens, low, high = (r * base_step / step for r in base_rates)
    kind = rate["basis"]
    row = Row(layout=layout, trial=trial, kind=kind, tokens_per_s=tokens, low=low, high=high, step_time_s=step,
              predicted=after, number=cand.number, confirmed=cand.confirmed(cfg),
              confirmations=len(cand.confirmations),
              objective=_objective(folder, new, cand, layout, predict),
              moved_s=_terms_moved(before, after), memory_before_gib=before.memory_gib)
    if copies(cfg, cand.layout):
        row.before = {"layout": base.short(), "gpus": cfg.production_gpus, "tokens_per_s": base_rates[0],
                      "step_time_s": base_step, "microbatches": microbatches(base)}
    idle = new.production_gpus - layout.world_size
    if idle:
        row.notes.append(f"{new.production_gpus} is not a multiple of {w}: {idle} GPUs idle (counted)")
    if not after.fits:
        row.notes.append(f"predicted {after.memory_gib:.1f} GiB at DP {layout.dp}, over the "
                         f"{cfg.memory_limit_gib:.1f} GiB limit")
        row.needs_trial = f"memory: its production layout at DP {layout.dp} is predicted over the limit"
    return row, ""


def _objective(folder: SweepFolder, new: SweepConfig, cand: Candidate, layout: Layout, predict: Any) -> float:
    """The candidate's figure at N' (``Candidate.figure``: its run at scale's, else the median over its runs on the
    trial's GPUs): each run's objective at N (the sweep's) with its production step moved as the estimator prices
    N' over N; at N' = N, the sweep's own."""
    cfg, cal = folder.cfg, folder.calibration
    per_gpu = cfg.search.objective == "tflops_per_gpu"
    base = cfg.production_layout(cand.layout)
    after = predict(layout)
    values = []
    for run in cand.figure_runs:
        ran = Layout.from_dict(run.layout)  # the trial's, or more GPUs at scale
        step = run.result.metrics.step_time_s
        if not step:
            values.append(0.0)
            continue
        if base is not None:
            before = predict(base)
            value = objective_value(run.result, cfg, ran, cal)
            base_step = projection(cfg, ran, step, cal).step_s
            scale = cfg.production_gpus / new.production_gpus if per_gpu else 1.0
        else:
            before = predict(cand.layout)
            value, base_step = float(getattr(run.result.metrics, cfg.search.objective) or 0.0), step
            scale = (layout.world_size / new.production_gpus) if per_gpu else (
                cfg.training.global_batch_size / cand.layout.gbs)
        moved = _moved(base_step, (after.step_time_s or 0.0) - (before.step_time_s or 0.0), before, after)
        values.append(value * scale * base_step / moved)
    return statistics.median(values)


def _choose(rows: list[Row], cfg: SweepConfig) -> Row | None:
    """The sweep's choice (``candidates.choose``) at N': the best median objective among confirmed layouts (every
    measured one when the sweep confirmed none: ``search.confirm_top: 0``); where none of those runs at N', the best
    measured layout never confirmed (a confirmation run of it is then needed)."""
    confirmed_only = cfg.search.confirm_top > 0
    ok = [r for r in rows if r.confirmed or not confirmed_only]
    unconfirmed = [r for r in rows if not r.confirmed and not r.confirmations]
    return max(ok or unconfirmed, key=lambda r: r.objective or 0.0, default=None)


def _predicted_rows(folder: SweepFolder, new: SweepConfig, measured: set[Layout], predict: Any,
                    top: int) -> tuple[list[Row], dict[str, int]]:
    """The best ``top`` production layouts at N' the sweep never measured, predicted through one term table."""
    cfg = folder.cfg
    tried = {Layout.from_dict(r.layout) for r in folder.records
             if r.phase == "explore" and r.result.status != "pruned" and not is_stable(r.result, cfg)}
    unsupported = {str(u.get("layout")) for u in (folder.meta.unsupported or []) if isinstance(u, dict)}
    checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length, cfg.run)
    by_production: dict[Layout, Layout] = {}
    with without_cycle_collection():
        for judged in judge(new, sorted(enumerate_layouts(_largest_sizes(new)), key=lambda lo: -lo.world_size),
                            checker):
            trial = judged.layout
            if judged.reasons or (unsupported and trial.short() in unsupported):
                continue
            layout = new.production_layout(trial)
            if layout is None or layout in measured or layout in by_production:
                continue
            by_production[layout] = trial
        # A layout the sweep launched and did not find stable (failed, over the memory limit) is not predicted
        # again: its trial's outcome stands (the report says why).
        launched = {new.production_layout(replace(t, gbs=new.trial_global_batch(t.world_size))) for t in tried}
        layouts = [lo for lo in by_production if lo not in launched]
        fitting, estimates = _fastest_fitting(Estimator.for_config(cfg, folder.calibration), layouts,
                                              folder.calibration, top)
        shown = fitting[:top]
    cal = folder.calibration
    kind = "predicted (calibrated)" if cal is not None and (cal.samples or cal.step_term_factors) else "predicted"
    rows = []
    for layout, estimate in zip([layouts[i] for i in shown], estimates, strict=True):
        tokens = estimate.tokens_per_s or 0.0
        trial = by_production[layout]
        row = Row(layout=layout, trial=trial, kind=kind, tokens_per_s=tokens,
                  low=tokens * cfg.estimate.throughput_low, high=tokens * cfg.estimate.throughput_high,
                  step_time_s=estimate.step_time_s or 0.0, predicted=estimate)
        base = cfg.production_layout(replace(trial, gbs=cfg.trial_global_batch(trial.world_size)))
        if base is not None and base.gbs == cfg.training.global_batch_size:
            try:
                before = predict(base)
            except (LayoutError, ValueError):
                before = None
            if before is not None and before.tokens_per_s:
                row.before = {"layout": base.short(), "gpus": cfg.production_gpus,
                              "tokens_per_s": before.tokens_per_s, "step_time_s": before.step_time_s,
                              "microbatches": microbatches(base)}
                row.moved_s = _terms_moved(before, estimate)
                row.memory_before_gib = before.memory_gib
        idle = new.production_gpus - layout.world_size
        if idle:
            row.notes.append(f"{new.production_gpus} is not a multiple of {trial.world_size}: {idle} GPUs idle")
        rows.append(row)
    counts = {"valid": len(by_production), "launched_not_stable": len(by_production) - len(layouts),
              "predicted": len(layouts), "over_memory": len(layouts) - len(fitting)}
    return rows, counts


def _fastest_fitting(estimator: Estimator, layouts: list[Layout], calibration: Calibration | None,
                     top: int) -> tuple[list[int], list[Estimate]]:
    """The indices of ``layouts`` predicted to fit with a throughput, fastest first (a stable order: the
    enumeration's among equals), through one term table, and the ``Estimate`` of the first ``top``. The table goes
    with the call, before the caller lets the cycle collector run again (alive, its first pass walks all of it)."""
    if not layouts:
        return [], []
    p = TermTable.build(estimator, layouts).predict(calibration)
    fits = np.flatnonzero(p.fits & (p.step_time_s > 0) & (p.tokens_per_s > 0))
    fitting = fits[np.argsort(-p.tokens_per_s[fits], kind="stable")].tolist()
    return fitting, p.estimates_of(fitting[:top])


def _largest_sizes(cfg: SweepConfig) -> SweepConfig:
    """``cfg`` with only the largest trial size of each production world size (W x N' // W): the trials of smaller
    sizes run the same production layouts (a space of powers of two: 64 to 1,024 GPUs all make the 1,024-GPU run),
    and a layout valid on fewer GPUs is valid on more that are a multiple of them; enumerating them all was most of
    a 1,024-GPU space's replan. A trial suggested for a predicted layout is then of the largest size."""
    largest: dict[int, int] = {}
    for w in cfg.world_sizes:
        world = w * cfg.copies(w)
        if world:
            largest[world] = max(largest.get(world, 0), w)
    if not largest:
        return cfg
    return cfg.model_copy(update={"space": cfg.space.model_copy(update={"gpus": sorted(largest.values())})})


def describe_moves(row: Row) -> str:
    """What moved for one layout from the sweep's N to N', e.g. ``micro-batches 16 -> 8; pipeline bubble +0.31 s``."""
    parts = []
    if row.before is not None:
        if row.before["microbatches"] != row.microbatches:
            parts.append(f"micro-batches per DP rank {row.before['microbatches']} -> {row.microbatches}")
        parts += [f"{term_name(t)} {d:+.3g} s" for t, d in list(row.moved_s.items())[:3]]
        if row.memory_before_gib is not None and abs(row.predicted.memory_gib - row.memory_before_gib) >= 0.05:
            parts.append(f"memory {row.memory_before_gib:.1f} -> {row.predicted.memory_gib:.1f} GiB at DP "
                         f"{row.layout.dp}")
    return "; ".join(parts)


def _why(plan: Replan) -> str:
    """Whether the sweep's winner is still the choice at N', and which terms moved."""
    n, was = plan.gpus, plan.original_gpus
    name = plan.original_layout or "the sweep's winner"
    if plan.original_number is None:
        head = "The sweep chose no winner."
    elif plan.original is None:
        reason = next((r["reason"] for r in plan.refused if r["number"] == plan.original_number), "it is not stable")
        head = f"The sweep's winner {name} cannot run on {n} GPUs: {reason}."
    else:
        o = plan.original
        at = f" (was {o.before['tokens_per_s']:,.0f} on {was})" if o.before else ""
        moves = describe_moves(o)
        head = (f"The sweep's winner {name} projects to {o.tokens_per_s:,.0f} tokens/s on {n} GPUs{at}"
                + (f": {moves}" if moves else "") + ".")
    w = plan.winner
    if w is None:
        tail = " No measured layout can be chosen at this size: a new trial (or sweep) is needed."
    elif not plan.winner_changed:
        tail = f" It stays the choice on {n} GPUs."
    else:
        moves = describe_moves(w)
        tail = (f" On {n} GPUs the choice becomes {w.trial.short()} (trial #{w.number}, as {w.layout.short()}): "
                f"{w.tokens_per_s:,.0f} tokens/s" + (f"; {moves}" if moves else "") + ".")
        if plan.original is not None and w.moved_s and plan.original.moved_s:
            tail += " Its step's terms moved less with the new data parallelism and micro-batch count."
    flagged = [r for r in plan.rows if r.needs_trial and r.number is None]
    if flagged:
        tail += (f" {len(flagged)} layout(s) never measured are predicted faster than the choice: each needs a trial "
                 f"before it replaces a measured layout (`sweeper trial SPACE --layout {flagged[0].trial.to_string()}`"
                 ").")
    if plan.folder.rehearsal:
        tail += f" Every figure is {MODELLED} (a rehearsal), not measured."
    return head + tail


__all__ = ["Replan", "Row", "SweepFolder", "at_gpus", "open_sweep", "replan", "sweep_calibration"]
