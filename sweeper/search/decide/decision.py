"""The decision (issue 18): for the winner and the runners-up, what training the budget would take and why each
layout is what it is.

Throughput is the measured median over a layout's runs on its trial's GPUs (exploration and confirmations, their
minimum and maximum as the band) when the trials ran on the cluster's GPUs; a layout that ran at scale
(``search.confirm_at_scale``: its production layout on N GPUs, or the most copies the cluster held) has that run's
measurement instead, none or less of its production step projected (issue 53). A CPU sweep measured the CPU, not the
GPUs the budget will run on: there the basis is the estimator's prediction for the configured cluster (calibrated
when the sweep calibrated it), with the band ``estimate.throughput_low`` .. ``throughput_high`` (how far measured
runs have lain from predictions). The production run puts ``N // W`` copies of the layout side by side (data
parallel): its step is the measured step plus what the larger data parallelism costs, priced by the estimator under
the sweep's calibration (``objective.Projection``). ``production`` says which part is measured (on the W GPUs the
figure ran on) and which projected (to the production run's N), and its band holds both: the runs' spread on the
measured part and the estimator's held-out step-time error (``objective.PROJECTED_STEP_ERROR``) on the projected
part (issue 53). A rehearsal's trials were modelled, not measured: its basis is "modelled" (issue 54), its figures
the rehearsal's modelled runs.

The "why" is one paragraph per layout: its predicted memory breakdown on the worst pipeline rank, the binding
constraint (memory when the peak is close to the stability limit, else step time), and what it traded: the layout
of the same size the estimator ranked fastest that the sweep did not choose, and why not (pruned, failed, over the
memory limit, or measured slower).
"""

from __future__ import annotations

import statistics
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.config.units import readable
from sweeper.estimate import Estimate, Estimator
from sweeper.estimate.calibration import Calibration
from sweeper.record.schema import MODELLED, TrialRecord
from sweeper.search.decide.candidates import Candidate
from sweeper.search.decide.objective import (
    PROJECTED_STEP_ERROR,
    copies,
    objective_value,
    production_gpus,
    production_rate,
    projection,
)
from sweeper.search.decide.verdicts import is_stable
from sweeper.space.axes import SEARCHED
from sweeper.space.layout import Layout

RUNNERS_UP = 2
# A layout whose peak memory is at least this share of the stability limit is bound by memory.
MEMORY_BINDS_AT = 0.9
SECONDS_PER_DAY = 86400.0
# The estimator's breakdown, grouped as a user reads it.
_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("weights", ("weights", "fp8_weights")),
    ("gradients", ("grads",)),
    ("optimizer state", ("optimizer", "grad_copies")),
    ("activations", ("activations",)),
    ("transients and logits", ("transient", "logits")),
    ("workspaces, fragmentation, CUDA/NCCL", ("workspaces", "fragmentation", "non_torch")),
)


def decision(cfg: SweepConfig, cands: list[Candidate], winner: Candidate | None, records: list[TrialRecord],
             calibration: Calibration | None = None, *, rehearsal: bool = False) -> dict[str, Any] | None:
    """The decision block of ``sweep.json``: the winner first, then up to ``RUNNERS_UP`` other stable layouts by
    their median objective; None when nothing was stable. ``rehearsal``: the records were modelled."""
    if winner is None and not cands:
        return None
    ranked = sorted((c for c in cands if winner is None or c.number != winner.number),
                    key=lambda c: -c.figure(cfg))
    chosen = ([winner] if winner is not None else []) + ranked[: RUNNERS_UP + (winner is None)]
    estimator = Estimator.for_config(cfg, calibration)
    predicted = [estimator(cand.layout) for cand in chosen]
    rates = [throughput(cfg, cand, p, calibration, rehearsal) for cand, p in zip(chosen, predicted, strict=True)]
    productions = [production(cfg, measured_layout(cand), rate, calibration)
                   for cand, rate in zip(chosen, rates, strict=True)]
    lead = productions[0]["tokens_per_s"]
    layouts = []
    for rank, (cand, estimated, rate, made) in enumerate(zip(chosen, predicted, rates, productions, strict=True)):
        entry: dict[str, Any] = {
            "number": cand.number, "layout": cand.layout.short(), "gpus": cand.layout.world_size,
            "role": "winner" if winner is not None and rank == 0 else "runner-up", "tokens_per_s": rate,
            # on the production run, as the choice compares them (not the trials' own rates on their W GPUs)
            "relative_to_first": made["tokens_per_s"] / lead if lead else None,
            "production": made,
        }
        if cfg.budget is not None:
            entry["projection"] = budget_projection(cfg, cand.layout, made)
        entry.update(_why(cfg, cand, records, estimated, MODELLED if rehearsal else "measured", calibration))
        layouts.append(entry)
    return {"budget": None if cfg.budget is None else cfg.budget.model_dump(), "layouts": layouts}


def _measured_on_gpus(cand: Candidate) -> bool:
    return cand.explore.result.memory_kind == "device"


def measured_layout(cand: Candidate) -> Layout:
    """The layout its figure was measured on: its run at scale's (issue 53), else its trial's."""
    at_scale = cand.at_scale
    return Layout.from_dict(at_scale.layout) if at_scale is not None and _measured_on_gpus(cand) else cand.layout


def throughput(cfg: SweepConfig, cand: Candidate, estimated: Estimate, calibration: Calibration | None,
               rehearsal: bool) -> dict[str, Any]:
    """A candidate's rate as the decision reports it, on the GPUs its figure ran on (``measured_layout``: its
    trial's W, or its run at scale's): its runs' median and spread when they ran on the cluster's GPUs (a
    rehearsal's modelled ones), else the estimator's prediction for the cluster's GPUs. A run at scale is one run:
    its band is the spread its runs on the trial's GPUs showed around their median (``runs``: 1)."""
    if _measured_on_gpus(cand):  # a rehearsal models its runs on the cluster's GPUs: their figures, modelled
        trial = [r.result.metrics for r in cand.trial_runs]
        values = [m.tokens_per_s for m in trial if m.tokens_per_s and m.tokens_per_s > 0]
        steps = [m.step_time_s for m in trial if m.step_time_s and m.step_time_s > 0]
        median, low, high = statistics.median(values), min(values), max(values)
        at_scale = cand.at_scale  # its figure is that one run's, on more GPUs than its trial's
        tokens = at_scale and at_scale.result.metrics.tokens_per_s
        if at_scale is not None and tokens:
            median, low, high = tokens, tokens * low / median, tokens * high / median
            values, steps = [tokens], [at_scale.result.metrics.step_time_s or 0.0]
        return {"basis": MODELLED if rehearsal else "measured", "median": median, "low": low, "high": high,
                "runs": len(values), "step_time_s": statistics.median(steps) if any(steps) else None,
                "on_gpus": measured_layout(cand).world_size}
    predicted = estimated.tokens_per_s or 0.0
    basis = "predicted (calibrated)" if calibration is not None and calibration.samples else "predicted"
    return {"basis": basis, "median": predicted, "low": predicted * cfg.estimate.throughput_low,
            "high": predicted * cfg.estimate.throughput_high, "runs": 0, "step_time_s": estimated.step_time_s,
            "on_gpus": cand.layout.world_size}


def production(cfg: SweepConfig, layout: Layout, rate: dict[str, Any],
               calibration: Calibration | None) -> dict[str, Any]:
    """The rate on the production run's N GPUs: the trial's (``rate``, on its W GPUs) times the copies, its step
    lengthened by the larger data parallelism's cost as the estimator prices it; how much of the step is measured
    and how much projected; the band: the runs' spread on the measured part, ``PROJECTED_STEP_ERROR`` on the
    projected part."""
    gpus, k = production_gpus(cfg), copies(cfg, layout)
    out: dict[str, Any] = {"gpus": gpus, "copies": k, "tokens_per_s": 0.0, "low": 0.0, "high": 0.0}
    step = rate.get("step_time_s")
    if k == 0:
        return out

    def at(tokens_per_s: float) -> float:
        return production_rate(cfg, layout, tokens_per_s, step, calibration=calibration)

    out.update(tokens_per_s=at(rate["median"]), low=at(rate["low"]), high=at(rate["high"]))
    if step:
        made = projection(cfg, layout, step, calibration)
        out["low"], out["high"] = made.band(out["low"])[0], made.band(out["high"])[1]
        out.update(step_time_s=made.step_s, measured_step_s=made.measured_step_s,
                   projected_step_s=made.projected_step_s, projected_share=made.projected_share,
                   projected_error=PROJECTED_STEP_ERROR,
                   priced_by="the calibrated estimator" if made.calibrated else "the uncalibrated estimator")
    out["basis"] = production_basis(rate["basis"], layout.world_size, gpus, out.get("projected_share", 0.0))
    return out


def production_basis(basis: str, trial_gpus: int, gpus: int, projected_share: float) -> str:
    """What a production figure is, e.g. ``measured on 8 GPUs, 57% of the step projected to 1024 GPUs``."""
    if trial_gpus == gpus:
        return f"{basis} on the production run's {gpus} GPUs"
    return f"{basis} on {trial_gpus} GPUs, {projected_share:.0%} of the step projected to {gpus} GPUs"


def budget_projection(cfg: SweepConfig, layout: Layout, made: dict[str, Any]) -> dict[str, Any]:
    """Days, GPU-hours and cost of ``budget.tokens`` on the production run (``production``: the layout's copies on N
    GPUs, slowed by the larger data parallelism) at its median, with its band (slow end, fast end)."""
    budget = cfg.budget
    assert budget is not None
    gpus, layout_gpus, k = production_gpus(cfg), layout.world_size, copies(cfg, layout)
    out: dict[str, Any] = {"gpus": gpus, "copies": k}
    if k == 0:
        out["note"] = f"the production run's {gpus} GPUs are fewer than the layout's {layout_gpus} GPUs"
        return out
    if gpus % layout_gpus:
        out["note"] = (f"{gpus} GPUs hold {k} copies of the {layout_gpus}-GPU layout; "
                       f"{gpus - k * layout_gpus} stay idle (counted in the cost)")
    for name, key in (("", "tokens_per_s"), ("_slow", "low"), ("_fast", "high")):
        tokens_per_s = made[key]
        seconds = budget.tokens / tokens_per_s if tokens_per_s > 0 else float("inf")
        out["days" + name] = seconds / SECONDS_PER_DAY
        out["gpu_hours" + name] = gpus * seconds / 3600.0
        if budget.gpu_hour_usd is not None:
            out["cost_usd" + name] = out["gpu_hours" + name] * budget.gpu_hour_usd
    return out


def _why(cfg: SweepConfig, cand: Candidate, records: list[TrialRecord], predicted: Estimate,
         measured_as: str, calibration: Calibration | None = None) -> dict[str, Any]:
    """``measured_as``: what the runs' figures are, "measured" or "modelled" (a rehearsal's)."""
    parts = {label: round(sum(predicted.breakdown.get(k, 0.0) for k in keys), 2) for label, keys in _PARTS}
    limit = cfg.memory_limit_gib
    measured = [r.result.metrics.peak_memory_gib for r in (cand.explore, *cand.confirmations)
                if r.result.metrics.peak_memory_gib is not None]
    on_gpus = _measured_on_gpus(cand)
    peak = max(measured) if on_gpus and measured else predicted.memory_gib
    share = peak / limit if limit else 0.0
    memory_text = ", ".join(f"{label} {gib:.1f}" for label, gib in parts.items() if gib >= 0.05)
    sentences = [
        f"{cand.layout.short()} on {cand.layout.world_size} GPUs: predicted {predicted.memory_gib:.1f} GiB on its "
        f"worst pipeline rank ({memory_text} GiB)"
        + (f", {measured_as} {max(measured):.1f} GiB" if on_gpus and measured else "") + "."]
    if share >= MEMORY_BINDS_AT:
        binding = "memory"
        sentences.append(f"Memory binds: it peaks at {share:.0%} of the {limit:.1f} GiB stability limit, so a "
                         "layout that keeps more per GPU would not be stable.")
    else:
        binding = "step time"
        sentences.append(f"Memory does not bind ({share:.0%} of the {limit:.1f} GiB limit): its step time does, "
                         "and a faster layout would spend the spare memory (fewer model-parallel ranks, larger "
                         "micro-batches, less recompute).")
    # Compared on the predictions the sweep launched with (the records'), so that every layout is priced alike.
    traded = _traded(cfg, cand, records, _predicted_production(cfg, cand.layout, cand.explore.predicted, predicted),
                     measured_as, calibration)
    sentences.append(traded)
    terms = predicted.step_time_terms_s
    if terms and predicted.step_time_s:
        top = sorted(terms.items(), key=lambda kv: -kv[1])[:4]
        shares = ", ".join(f"{name} {seconds / predicted.step_time_s:.0%}" for name, seconds in top)
        sentences.append(f"Its predicted step of {predicted.step_time_s:.3g} s is mostly {shares} (plan --json "
                         "step_time_terms_s lists every term).")
    return {"memory_gib": parts, "peak_share_of_limit": round(share, 3), "binding": binding,
            "step_time_terms_s": {k: round(v, 6) for k, v in terms.items()}, "why": " ".join(sentences)}


def _predicted_production(cfg: SweepConfig, layout: Layout, recorded: dict[str, Any] | None,
                          fallback: Estimate | None = None) -> float:
    """The estimator's tokens/s for ``layout`` on the production run, from the prediction a record launched with
    (``fallback``: the decision's own, where the record has none)."""
    tokens = (recorded or {}).get("tokens_per_s") or (fallback.tokens_per_s if fallback else None)
    step = (recorded or {}).get("step_time_s") or (fallback.step_time_s if fallback else None)
    if not isinstance(tokens, (int, float)) or not isinstance(step, (int, float)) or tokens <= 0 or step <= 0:
        return 0.0
    return production_rate(cfg, layout, float(tokens), float(step))


def _traded(cfg: SweepConfig, cand: Candidate, records: list[TrialRecord], own: float, measured_as: str,
            calibration: Calibration | None = None) -> str:
    """The layout of the same size the estimator ranked fastest above this one on the production run, and why the
    sweep did not take it."""
    faster: dict[Layout, tuple[TrialRecord, float]] = {}
    for rec in records:
        lo = rec.layout
        if lo.get("gpus") != cand.layout.world_size or rec.number == cand.number:
            continue
        key = Layout.from_dict(lo)
        theirs = _predicted_production(cfg, key, rec.predicted)
        if theirs <= own:
            continue
        # The attempt that says the most: a launched one over a refusal, the latest of equals.
        if key not in faster or rec.attempt >= faster[key][0].attempt:
            faster[key] = (rec, theirs)
    if not faster:
        return "No layout of this size that the sweep tried was predicted faster on the production run."
    other, (best, theirs) = max(faster.items(), key=lambda kv: kv[1][1])
    diff = ", ".join(f"{a.name} {a.value(other)} instead of {a.value(cand.layout)}" for a in SEARCHED
                     if a.name != "gpus" and a.value(other) != a.value(cand.layout))
    gain = theirs / own - 1 if own else 0.0
    result = best.result
    if result.status == "pruned":
        why = f"it was not launched: {result.error}"
    elif result.status == "failed":
        why = f"it failed ({result.failure_kind}): {(result.error or '').splitlines()[0] if result.error else ''}"
    elif not is_stable(result, cfg):
        peak = result.metrics.peak_memory_gib
        why = (f"it passed but was not stable (peak {peak:.1f} GiB over the {cfg.memory_limit_gib:.1f} GiB limit, or "
               "a TP group across nodes)" if peak is not None else "it passed but was not stable")
    else:  # both on the production run, as the choice compares them
        n, unit = production_gpus(cfg), cfg.search.objective
        measured, mine = objective_value(result, cfg, other, calibration), cand.figure(cfg)
        if measured > mine:
            why = (f"it {measured_as} faster in exploration ({measured:,.0f} {unit} projected to {n} GPUs) but was "
                   "not confirmed (a confirmation failed, drifted or was not run)")
        else:
            why = f"it ran stable but {measured_as} slower ({measured:,.0f} {unit} projected to {n} GPUs)"
    return (f"It trades the estimator's faster {other.short()} ({diff or 'same axes'}; predicted {gain:+.0%} on the "
            f"production run): {why.rstrip(': ')}.")


def summary_line(block: dict[str, Any] | None) -> str | None:
    """One console line for the winner's projection, e.g. ``budget 1e+12 tokens on 1024 GPUs: 12.3 days (9.1-15),
    302,000 GPU-hours, $755,000 (predicted throughput)``; None without a budget or a winner."""
    layouts = (block or {}).get("layouts") or []
    if not layouts or layouts[0].get("role") != "winner" or "days" not in (layouts[0].get("projection") or {}):
        return None
    first = layouts[0]
    p, budget = first["projection"], block["budget"]  # type: ignore[index]
    r = readable
    cost = f", ${r(p['cost_usd'])}" if "cost_usd" in p else ""
    return (f"budget {budget['tokens']:.3g} tokens on {p['gpus']} GPUs: {r(p['days'])} days "
            f"({r(p['days_fast'])}-{r(p['days_slow'])}), {r(p['gpu_hours'])} GPU-hours{cost} "
            f"(throughput {first['production']['basis']})")
