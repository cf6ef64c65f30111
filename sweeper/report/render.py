"""The sweep report: one self-contained HTML page rendered only from what a sweep recorded in its directory.

``render_report(sweep_dir)`` reads ``trials.jsonl`` (one line per trial attempt, docs/ARCHITECTURE.md contract) and
``sweep.json`` (sweep metadata; may be missing), classifies every attempt (passed and within the memory headroom,
passed but over it, failed, pruned), and writes ``report.html`` atomically so that a browser or a concurrent
``sweeper report`` never sees half a file. A sweep that crashed mid-write leaves a torn last line; it is skipped and
the report says how many lines it could not read. Figures come from ``sweeper.report.figures``; plotly.js is inlined
once so the page opens offline.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sweeper.config import megatron_release
from sweeper.config.files import write_atomic
from sweeper.config.units import GIB, readable
from sweeper.errors import LayoutError
from sweeper.models.proxy import PROXY_NOTE, is_proxy
from sweeper.record.schema import MODELLED, REHEARSAL_NOTE, SweepMeta, is_rehearsal
from sweeper.record.sweepdir import read_meta
from sweeper.report import figures
from sweeper.report.figures import esc, kind_counts, num
from sweeper.report.rows import TrialRow, load_trials
from sweeper.space.layout import Layout

TRIALS_FILE = "trials.jsonl"
SWEEP_FILE = "sweep.json"
REPORT_FILE = "report.html"
BEST_LAYOUT_FILE = "best_layout.yaml"


def _classify(rows: list[TrialRow], limit_gib: float | None) -> None:
    for row in rows:
        if row.result.status == "passed":
            peaks = [p for p in (row.peak_memory_gib, row.result.metrics.stress_peak_memory_gib) if p is not None]
            over = limit_gib is not None and any(p > limit_gib for p in peaks)  # under routing stress too
            row.category = "not stable" if over else "passed"
        else:
            row.category = row.result.status if row.result.status in ("failed", "pruned") else "failed"


def pareto_front(rows: list[TrialRow]) -> list[TrialRow]:
    """Stable explore-phase attempts that no other is better than on both throughput (max) and memory (min)."""
    candidates = [
        r for r in rows
        if r.category == "passed" and r.phase != "confirm" and r.tokens_per_s is not None
        and r.peak_memory_gib is not None
    ]
    candidates.sort(key=lambda r: (r.peak_memory_gib, -(r.tokens_per_s or 0.0)))
    front: list[TrialRow] = []
    for row in candidates:
        if not front or (row.tokens_per_s or 0.0) > (front[-1].tokens_per_s or 0.0):
            front.append(row)
    return front


def _memory_kind(info: SweepMeta, rows: list[TrialRow]) -> str | None:
    if info.memory_kind in ("device", "host"):
        return info.memory_kind
    kinds = {r.result.memory_kind for r in rows if r.result.memory_kind}
    if "host" in kinds or any(r.result.backend.endswith("-cpu") for r in rows):
        return "host"
    return "device" if "device" in kinds else None


# -- sections -----------------------------------------------------------------------------------------------------
def _memory_label(kind: str | None, rehearsal: bool) -> str:
    if rehearsal:
        return f"{MODELLED} peak GPU memory (GiB, max over ranks; a rehearsal)"
    if kind == "host":
        return "peak host RSS per rank (GiB, max over ranks; CPU backend)"
    if kind == "device":
        return "peak reserved GPU memory (GiB, max over ranks)"
    return "peak memory (GiB, max over ranks)"


def _why_no_stable(rows: list[TrialRow]) -> str:
    """One sentence on why nothing was selectable, from the counts alone."""
    launched = [r for r in rows if r.category != "pruned"]
    if not rows:
        return "No trial was recorded."
    if not launched:
        return f"All {len(rows)} recorded layouts were pruned before launch (see the pruned reasons below)."
    over = sum(r.category == "not stable" for r in launched)
    failed = kind_counts(launched, "failed")
    parts = [f"{len(launched)} launched attempts, none passed within the memory headroom"]
    if over:
        parts.append(f"{over} passed but used more memory than the headroom allows")
    if failed:
        kind, count = failed.most_common(1)[0]
        parts.append(f"most common failure: {kind} ({count})")
    return "; ".join(parts) + "."


def _best_section(info: SweepMeta, recorded: bool, rows: list[TrialRow], sweep_dir: Path) -> str:
    kind = f" ({MODELLED}, a rehearsal)" if info.rehearsal else ""
    best = info.best or {}
    best_number = best.get("number")
    link = (f'<a href="{BEST_LAYOUT_FILE}">{BEST_LAYOUT_FILE}</a>' if (sweep_dir / BEST_LAYOUT_FILE).exists()
            else f"{BEST_LAYOUT_FILE} (not written)")
    if best_number is None:
        fastest = max((r for r in rows if r.category == "passed" and r.tokens_per_s is not None),
                      key=lambda r: r.tokens_per_s or 0.0, default=None)
        if not recorded:
            head = f"<p>{SWEEP_FILE} is missing, so the sweep's own selection is unknown.</p>"
        elif info.status == "running":
            head = "<p>The sweep is still running; no layout selected yet.</p>"
        else:
            head = f'<p class="bad">No stable layout was selected. {esc(_why_no_stable(rows))}</p>'
        if fastest is not None:
            head += (f"<p>Fastest stable attempt recorded: <b>{esc(fastest.name)}</b> (trial {fastest.number}), "
                     f"{num(fastest.tokens_per_s, '{:,.0f}')} tokens/s, "
                     f"{num(fastest.peak_memory_gib, '{:.2f}')} GiB peak.</p>")
        return head
    same = [r for r in rows if r.number == best_number]
    passed = [r for r in same if r.category in ("passed", "not stable")]
    # The sweep chooses on the median of the confirmation runs, so show that figure when it did not record one.
    basis = [r for r in passed if r.phase == "confirm"] or passed
    tokens = best.get("tokens_per_s")
    # sweep.json's best is the objective on the production run: say what part of it was measured (issue 53)
    winner = next((e for e in (info.decision or {}).get("layouts") or [] if e.get("role") == "winner"), None)
    made = (winner or {}).get("production") or {}
    what = f"on the production run ({made['basis']})" if isinstance(tokens, (int, float)) and made.get("basis") \
        else "on the production run" if isinstance(tokens, (int, float)) else ""
    if not isinstance(tokens, (int, float)):
        measured = [r.tokens_per_s for r in basis if r.tokens_per_s is not None]
        tokens = statistics.median(measured) if measured else None
        what = "measured on its own GPUs (median of its runs)"
    peak = best.get("peak_memory_gib")
    if not isinstance(peak, (int, float)):
        peaks = [r.peak_memory_gib for r in basis if r.peak_memory_gib is not None]
        peak = max(peaks) if peaks else None
    layout = next((r.built for r in same if r.built is not None), None)
    if layout is None and isinstance(best.get("layout"), dict):
        try:
            layout = Layout.from_dict(best["layout"])
        except (LayoutError, TypeError):
            layout = None
    name = layout.short() if layout is not None else f"trial {best_number}"
    confirm = [r for r in same if r.phase == "confirm"]
    confirm_note = (f", confirmed by {sum(r.category == 'passed' for r in confirm)}/{len(confirm)} runs"
                    if confirm else "")
    flags = (f"<pre>{esc(' '.join(layout.megatron_args(megatron_release.graph_modules())))}</pre>"
             if layout is not None else "")
    return (
        f'<p class="good">Best stable layout: <b>{esc(name)}</b> (trial {esc(best_number)}{confirm_note}) — '
        f"{num(tokens, '{:,.0f}')} tokens/s {esc(what)}, {num(peak, '{:.2f}')} GiB peak memory{kind}.</p>"
        f"<p>Full Megatron flags and Megatron-Bridge overrides: {link}. Layout flags:</p>{flags}"
    )


def _amount(value: float | None, unit: str = "") -> str:
    return "–" if value is None else unit + readable(value)


def _band(low: float | None, high: float | None, unit: str = "") -> str:
    if low is None or high is None:
        return ""
    return f" <span class='dim'>({_amount(low, unit)} – {_amount(high, unit)})</span>"


def decision_section(info: SweepMeta) -> str:
    """The winner and runners-up with the budget's projected time and cost and why (sweep.json ``decision``)."""
    block = info.decision or {}
    layouts = block.get("layouts") or []
    if not layouts:
        return '<p class="note">No stable layout: nothing to project.</p>'
    budget = block.get("budget")
    rows = []
    for e in layouts:
        rate, proj = e.get("tokens_per_s") or {}, e.get("projection") or {}
        made = e.get("production") or {}
        on = f" on {rate['on_gpus']} GPUs" if rate.get("on_gpus") else ""
        row = [esc(e.get("role")), f"{esc(e.get('layout'))} <span class='dim'>(trial {esc(e.get('number'))})</span>",
               esc(f"{rate.get('basis')}{on}"),
               _amount(rate.get("median")) + _band(rate.get("low"), rate.get("high")),
               _amount(made.get("tokens_per_s")) + _band(made.get("low"), made.get("high")),
               esc(made.get("basis"))]
        if budget:
            row += [_amount(proj.get("gpus")),
                    _amount(proj.get("days")) + _band(proj.get("days_fast"), proj.get("days_slow")),
                    _amount(proj.get("gpu_hours"))]
            if budget.get("gpu_hour_usd") is not None:
                row.append(_amount(proj.get("cost_usd"), "$")
                           + _band(proj.get("cost_usd_fast"), proj.get("cost_usd_slow"), "$"))
        rows.append(row)
    headers = ["", "layout (in the sweep's order)", "its trials' figure", "tokens/s on its trials' GPUs (band)",
               "tokens/s on the production run (band)", "the production figure is"]
    error = next((e["production"]["projected_error"] for e in layouts
                  if "projected_error" in (e.get("production") or {})), None)
    copies_text = ("Copies of a layout side by side fill the production run's GPUs (data parallel): its step is the "
                   "step its trials measured (or, on the CPU backend, the estimator predicted) plus what the larger "
                   "data parallelism costs, projected by the estimator under the sweep's calibration; the band holds "
                   "the runs' spread and" + (f" ±{error:.1%} (the estimator's held-out step-time error)" if error
                                             else " the estimator's error") + " on the projected part.")
    if budget:
        headers += ["GPUs", "days (band)", "GPU-hours"] + (["cost (band)"] if budget.get("gpu_hour_usd") else [])
        price = (f" at ${budget['gpu_hour_usd']:g} per GPU-hour" if budget.get("gpu_hour_usd") else "")
        intro = f"<p>Training {budget.get('tokens', 0):.3g} tokens{esc(price)}. {esc(copies_text)}</p>"
    else:
        intro = (f"<p>{esc(copies_text)}</p><p class='note'>No <code>budget:</code> in the YAML (e.g. <code>budget: "
                 "{tokens: 1.0e12, gpu_hour_usd: 2.5, gpus: 1024}</code>): no projected time or cost.</p>")
    notes = []
    if any(str((e.get("tokens_per_s") or {}).get("basis", "")).startswith("predicted") for e in layouts):
        notes.append("Predicted throughput: these trials did not run on the cluster's GPUs (the CPU backend), so "
                     "the rate is the estimator's for the configured GPUs and its band is estimate.throughput_low .. "
                     "throughput_high times it (how far measured runs have lain from predictions).")
    if any((e.get("tokens_per_s") or {}).get("basis") == MODELLED for e in layouts):
        notes.append("Modelled throughput: a rehearsal's runs, the estimator's prediction with its error drawn on a "
                     "virtual clock; no layout ran, and these days and costs are what the rehearsal's model says.")
    whys = "".join(f"<p><b>{esc(e.get('layout'))}</b> — {esc(e.get('why'))}</p>" for e in layouts)
    return (intro + figures.html_table(headers, rows)
            + "".join(f'<p class="caveat">{esc(n)}</p>' for n in notes) + whys)


def step_time_section(info: SweepMeta) -> str:
    """The step-time terms' fit (sweep.json ``step_time_fit``): its factors, and each measured trial's step time
    next to the uncalibrated and the calibrated prediction."""
    fit = info.step_time_fit or {}
    trials = fit.get("trials") or []
    if not trials:
        return '<p class="note">No passed trial measured a step time.</p>'
    factors = ", ".join(f"{esc(t)} x{f:.3g}" for t, f in sorted((fit.get("factors") or {}).items()))

    def pct(key: str) -> str:
        value = fit.get(key)
        return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "n/a"

    measured = MODELLED if info.rehearsal else "measured"
    intro = (f"<p>{measured.capitalize()} on {esc(fit.get('backend'))}: every term "
             f"x{fit.get('level', 1.0):.3g} (the level)"
             + (f"; fitted on their own: {factors}" if factors else "; no term fitted on its own yet")
             + f". Median error over these trials: {pct('error_uncalibrated')} uncalibrated, "
             f"{pct('error_one_factor')} with one factor, {pct('error_calibrated')} term by term. The study's "
             f"proposals after the second {measured} trial are the refit model's best untried layouts.</p>")
    if info.rehearsal:
        intro += ("<p class='caveat'>A rehearsal: each modelled step time is the estimator's own with a drawn error, "
                  "so this compares the estimator with itself; it shows the fit at work, not the estimator's "
                  "accuracy.</p>")
    rows = [[esc(r.get("trial")), esc(r.get("layout")), num(r.get("measured_s"), "{:.4g}"),
             num(r.get("uncalibrated_s"), "{:.4g}"), num(r.get("calibrated_s"), "{:.4g}")] for r in trials]
    return intro + figures.html_table(["trial", "layout", f"{measured} s", "uncalibrated s", "calibrated s"], rows)


def _disk_text(info: SweepMeta, rows: list[TrialRow]) -> str:
    """The trials' checkpoints (issue 43): the largest one, how many were kept through the trial, and what the sweep's
    end left and freed (sweep.json ``checkpoints``)."""
    sizes = [r.result.checkpoint_bytes for r in rows if r.result.checkpoint_bytes is not None]
    if not sizes:
        return "no trial saved one"
    kept = sum(1 for r in rows if r.result.checkpoint_bytes is not None and not r.result.checkpoint_deleted)
    text = (f"{len(sizes)} saved, up to {max(sizes) / GIB:.2f} GiB each; {kept} kept past their reload, "
            f"{len(sizes) - kept} deleted after it")
    end = info.checkpoints or {}
    if end:
        text += (f"; at the end (keep_checkpoints: {end.get('keep')}) {len(end.get('kept') or [])} left, "
                 f"{int(end.get('freed_bytes') or 0) / GIB:.2f} GiB freed")
    return text


def _header(info: SweepMeta, recorded: bool, rows: list[TrialRow], skipped: int, memory_kind: str | None,
            sweep_dir: Path) -> str:
    model = info.model or {}
    model_bits = [f"{k}={model[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads", "num_moe_experts",
                                              "moe_router_topk") if model.get(k) is not None]
    cluster = info.cluster or {}
    cluster_text = (f"{cluster.get('nodes', '?')} × {cluster.get('gpus_per_node', '?')} GPUs, "
                    f"{cluster.get('gpu_memory_gib', '?')} GiB each" if cluster else "not recorded")
    limit = info.memory_limit_gib
    headroom = (f"{limit:.1f} GiB = (1 − {info.memory_headroom:g}) × {cluster.get('gpu_memory_gib')} GiB"
                if limit is not None else "not recorded")
    mlflow = info.mlflow or {}
    facts = [
        ("Model", f"{esc(model.get('name', 'not recorded'))} <span class='dim'>{esc(' '.join(model_bits))}</span>"),
        ("Checkpoints on disk", esc(_disk_text(info, rows))),
        ("Cluster", esc(cluster_text)),
        ("Status", esc(info.status or "not recorded")),
        ("Objective", esc(info.objective or "not recorded")),
        ("Memory limit (stability)", esc(headroom)),
        ("Started / ended", f"{esc(info.started_at or '–')} / {esc(info.ended_at or '–')}"),
        ("MLflow", (esc(" · ".join(f"{k}: {mlflow[k]}" for k in ("tracking_uri", "experiment", "parent_run_id")
                                  if mlflow.get(k))) or "not recorded")
         + (f' · <a href="{esc(url)}">open the sweep\'s run</a>'
            if (url := figures.mlflow_run_url(mlflow, mlflow.get("parent_run_id"))) else "")),
    ]
    notes = []
    banner = (f"<p class='rehearsal'><b>{MODELLED.upper()}, NOT MEASURED.</b> This sweep is {esc(REHEARSAL_NOTE)}. "
              "Every throughput, step time and peak memory below is modelled.</p>" if info.rehearsal else "")
    if not recorded:
        notes.append(f"{SWEEP_FILE} was not found or could not be read: model, cluster, status and the memory "
                     "limit are unknown, so no attempt is marked 'not stable'.")
    if is_proxy(str(model.get("name", ""))):
        notes.append(f"A {PROXY_NOTE}.")
    if memory_kind == "host":
        notes.append("Memory is host RSS: these trials ran on the CPU backend, where there is no device memory, so "
                     "every 'peak memory' below is the ranks' peak resident host memory, not GPU memory. The "
                     "headroom line compares it with the configured GPU memory only as a rough guide.")
    reference = info.reference or {}
    if info.reference is not None and not reference.get("path"):
        notes.append(f"No equivalence gate: {reference.get('note') or 'the reference could not be made'}. No trial "
                     "proved it computes the model, so none is stable unless search.require_equivalence is false.")
    if skipped:
        notes.append(f"{skipped} line(s) of {TRIALS_FILE} could not be read and were skipped (a torn last line is "
                     "what a sweep that crashed mid-write leaves).")
    notes_html = "".join(f'<p class="caveat">{esc(n)}</p>' for n in notes)
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in facts)
    title = esc(info.name or sweep_dir.name) + (" (a rehearsal)" if info.rehearsal else "")
    return (f"<h1>Sweep report: {title}</h1>{banner}{notes_html}<dl>{dl}</dl>"
            f"<h2 id='best'>Best layout</h2>{_best_section(info, recorded, rows, sweep_dir)}"
            f"<h2 id='decision'>Decision: time and cost to train</h2>{decision_section(info)}"
            f"<h2 id='counts'>Counts</h2>{figures.counts_table(rows)}")


@dataclass
class _Page:
    """What the page and the MLflow parent run are drawn from."""

    info: SweepMeta
    recorded: bool
    rows: list[TrialRow]
    skipped: int
    memory_kind: str | None
    memory_label: str
    front: list[TrialRow]
    figures: dict[str, Any]  # plotly figures by name, None where there is nothing to draw
    median_error: float | None


def _page(sweep_dir: Path) -> _Page:
    meta = read_meta(sweep_dir / SWEEP_FILE)
    info = meta or SweepMeta()
    rows, skipped = load_trials(sweep_dir / TRIALS_FILE)
    info.rehearsal = is_rehearsal(info, rows)  # a rehearsal's folder from before sweep.json said so: its trials do
    limit = info.memory_limit_gib
    _classify(rows, limit)
    memory_kind = _memory_kind(info, rows)
    rehearsal = bool(info.rehearsal)
    memory_label = _memory_label(memory_kind, rehearsal)
    front = pareto_front(rows)
    limit_label = (f"headroom limit {limit:.1f} GiB" if limit is not None else "")
    # Neither a CPU sweep's host RSS nor a rehearsal's modelled peaks (the estimator's own, drawn) test the estimator.
    accuracy, median_error = (None, None) if memory_kind == "host" or rehearsal else figures.predicted_vs_measured(
        rows, memory_label)
    drawn = {
        "throughput_vs_memory": figures.throughput_vs_memory(rows, front, limit, limit_label, memory_label),
        "predicted_vs_measured": accuracy,
        "failures": figures.failures_and_pruned(kind_counts(rows, "failed"), kind_counts(rows, "pruned")),
        "axis_effects": figures.axis_effects(rows),
    }
    return _Page(info, meta is not None, rows, skipped, memory_kind, memory_label, front, drawn, median_error)


def report_figures(sweep_dir: Path) -> dict[str, Any]:
    """The report's figures that have something to show, by name (the sweep logs them on its MLflow run)."""
    return {name: fig for name, fig in _page(Path(sweep_dir)).figures.items() if fig is not None}


def build_html(sweep_dir: Path) -> str:
    """The report page for ``sweep_dir`` as one string (plotly.js included once)."""
    page = _page(sweep_dir)
    info, rows, front, drawn = page.info, page.rows, page.front, page.figures
    fig_html = figures.FigureHtml()
    pareto_body = [[str(r.number), esc(r.name), num(r.tokens_per_s, "{:,.0f}"), num(r.peak_memory_gib, "{:.2f}")]
                   for r in front]
    pareto_html = (figures.html_table(["trial", "layout", "tokens/s", "peak mem (GiB)"], pareto_body) if front
                   else '<p class="note">No stable trial with measured throughput and memory.</p>')
    measured = MODELLED if info.rehearsal else "measured"
    if info.rehearsal:
        accuracy = ('<p class="note">Not drawn: a rehearsal\'s peaks are the estimator\'s own predictions with a '
                    "drawn error, so the chart would compare the estimator with itself (a sweep on the cluster draws "
                    "it).</p>")
    elif page.memory_kind == "host":
        accuracy = ('<p class="note">Not drawn: this sweep ran on the CPU backend, which measures host RSS, while '
                    "the estimator predicts GPU memory; the two are not comparable (a GPU sweep draws this).</p>")
    else:
        accuracy = (f"<p>Median absolute error of the memory prediction: <b>{page.median_error:.1f}%</b> over "
                    f"passed attempts.</p>" if page.median_error is not None else "") + fig_html.div(
            drawn["predicted_vs_measured"], "No passed attempt has both a predicted and a measured peak memory.")

    sections = [
        _header(info, page.recorded, rows, page.skipped, page.memory_kind, sweep_dir),
        "<h2 id='throughput-memory'>Throughput vs peak memory</h2>",
        fig_html.div(drawn["throughput_vs_memory"], "No launched attempt recorded a peak memory."),
        "<h2 id='pareto'>Pareto front (max throughput, min memory, stable only)</h2>", pareto_html,
        f"<h2 id='memory-accuracy'>Predicted vs {measured} peak memory</h2>", accuracy,
        f"<h2 id='step-time'>Predicted vs {measured} step time</h2>", step_time_section(info),
        "<h2 id='failures'>Failures and pruned layouts</h2>",
        fig_html.div(drawn["failures"], "No attempt failed and no layout was pruned."),
        figures.pruned_reasons_table(rows),
        figures.memory_pruned_table(info.memory_pruned or []),
        figures.dominated_table(info.dominated or [], info.stopped_early, measured),
        figures.unsupported_table(info.unsupported or []),
        "<h2 id='axis-effects'>Per-axis effect on throughput</h2>",
        fig_html.div(drawn["axis_effects"], "No axis took more than one value among passed trials."),
        f"<h2 id='attempts'>Every trial attempt ({len(rows)})</h2>", figures.attempts_table(rows, info.mlflow),
        f"<p class='note'>Rendered {datetime.now(timezone.utc).isoformat(timespec='seconds')} from {TRIALS_FILE}"
        f" and {SWEEP_FILE}.</p>",
    ]
    title = esc(f"sweeper report: {info.name or sweep_dir.name}" + (" (a rehearsal)" if info.rehearsal else ""))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{figures.CSS}</style></head><body>{''.join(sections)}</body></html>")


def render_report(sweep_dir: Path) -> Path:
    """Render ``sweep_dir/report.html`` from the sweep's recorded files and return its path.

    Raises FileNotFoundError when ``sweep_dir`` holds neither trials.jsonl nor sweep.json (not a sweep directory).
    """
    sweep_dir = Path(sweep_dir)
    if not (sweep_dir / TRIALS_FILE).exists() and not (sweep_dir / SWEEP_FILE).exists():
        raise FileNotFoundError(f"{sweep_dir}: no {TRIALS_FILE} or {SWEEP_FILE}; not a sweep directory")
    path = sweep_dir / REPORT_FILE
    write_atomic(path, build_html(sweep_dir))
    return path
