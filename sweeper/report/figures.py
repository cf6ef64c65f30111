"""Figures (plotly) and tables (HTML) of the sweep report, built from the rows ``sweeper.report.render`` loaded.

Presentation only: every decision (which attempt is stable, which trials are on the Pareto front) is made in
``sweeper.report.render`` and arrives here as plain row fields. User text (layout names, error messages) is escaped
before it reaches a figure, because plotly renders a subset of HTML in hover labels.
"""

from __future__ import annotations

import html
import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from sweeper.config.units import GIB
from sweeper.report.rows import TrialRow
from sweeper.space.axes import AXIS, PRECISIONS, SEARCHED
from sweeper.space.layout import RECOMPUTES

# One colour per report category, shared by the scatter and the attempts table so a reader matches them by eye.
CATEGORY_COLORS: dict[str, str] = {
    "passed": "#2a9d8f",
    "not stable": "#e9a23b",
    "failed": "#d1495b",
    "pruned": "#8d99ae",
}
# Axes a Megatron user tunes: the searched axes of the axis table ("gpus" is the trial world size).
EFFECT_AXES: tuple[str, ...] = tuple(a.name for a in SEARCHED)
_HOVER_ERROR_CHARS = 160
_ERROR_CHARS = 200  # error text shown in the attempts table; the full text is in the cell's tooltip


def _hover(row: TrialRow, memory_note: str = "") -> str:
    """Escaped hover text: layout short name, trial number, metrics, and the failure when there is one."""
    parts = [f"<b>{html.escape(row.name)}</b>", f"trial {row.number} attempt {row.attempt} ({html.escape(row.phase)})"]
    if row.tokens_per_s is not None:
        parts.append(f"tokens/s {row.tokens_per_s:,.0f}")
    if row.peak_memory_gib is not None:
        parts.append(f"peak memory {row.peak_memory_gib:.2f} GiB")
    if memory_note:
        parts.append(memory_note)
    if row.result.failure_kind:
        parts.append(f"failure: {html.escape(row.result.failure_kind)}")
    if row.result.error:
        error = row.result.error.strip().splitlines()[0] if row.result.error.strip() else ""
        if len(error) > _HOVER_ERROR_CHARS:
            error = error[: _HOVER_ERROR_CHARS - 1] + "…"
        parts.append(html.escape(error))
    return "<br>".join(parts)


def throughput_vs_memory(
    rows: Sequence[TrialRow],
    pareto: Sequence[TrialRow],
    limit_gib: float | None,
    limit_label: str,
    memory_label: str,
) -> go.Figure | None:
    """Tokens/s against peak memory, one trace per category, the headroom limit and the Pareto front.

    Failed attempts have no throughput; they sit on y=0 at their measured peak (an OOM's last reading) or, when
    nothing was measured, at the predicted memory, so a reader sees where in memory the failures cluster.
    """
    fig = go.Figure()
    plotted = 0
    for category in ("passed", "not stable", "failed"):
        xs: list[float] = []
        ys: list[float] = []
        texts: list[str] = []
        symbols: list[str] = []
        for row in rows:
            if row.category != category:
                continue
            x, note = row.peak_memory_gib, ""
            if x is None and category == "failed" and row.predicted_memory_gib is not None:
                x, note = row.predicted_memory_gib, "x = predicted memory (nothing measured)"
            if x is None:
                continue
            xs.append(x)
            ys.append(row.tokens_per_s if row.tokens_per_s is not None else 0.0)
            texts.append(_hover(row, note))
            symbols.append("diamond" if row.phase == "confirm" else ("x" if category == "failed" else "circle"))
        if not xs:
            continue
        plotted += len(xs)
        fig.add_trace(
            go.Scatter(
                x=xs, y=ys, mode="markers", name=category, hovertext=texts, hoverinfo="text",
                marker={"color": CATEGORY_COLORS[category], "size": 10, "symbol": symbols, "opacity": 0.85},
            )
        )
    if not plotted:
        return None
    front = sorted(pareto, key=lambda r: r.peak_memory_gib or 0.0)
    if front:
        fig.add_trace(
            go.Scatter(
                x=[r.peak_memory_gib for r in front], y=[r.tokens_per_s for r in front], mode="lines+markers",
                name="Pareto front (stable)", line={"color": "#264653", "width": 2, "shape": "hv"},
                marker={"size": 14, "symbol": "circle-open", "color": "#264653"},
                hovertext=[_hover(r) for r in front], hoverinfo="text",
            )
        )
    if limit_gib is not None:
        fig.add_vline(
            x=limit_gib, line_dash="dash", line_color="#d1495b",
            annotation_text=html.escape(limit_label), annotation_position="top left",
        )
    fig.update_layout(
        title="Throughput vs peak memory (◆ = confirmation run)", xaxis_title=memory_label, yaxis_title="tokens/s",
        height=520, legend={"orientation": "h", "y": -0.15}, margin={"t": 60},
    )
    return fig


def predicted_vs_measured(rows: Sequence[TrialRow], memory_label: str) -> tuple[go.Figure | None, float | None]:
    """Predicted against measured peak memory with the y=x line; returns the figure and the median |error| in %."""
    pairs = [  # (row, measured, predicted)
        (r, r.peak_memory_gib, r.predicted_memory_gib) for r in rows
        if r.category in ("passed", "not stable") and r.predicted_memory_gib is not None and r.peak_memory_gib
    ]
    if not pairs:
        return None, None
    errors = [abs(predicted - measured) / measured * 100 for _, measured, predicted in pairs]
    median_error = statistics.median(errors)
    hi = max(max(measured, predicted) for _, measured, predicted in pairs) * 1.05
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(x=[0, hi], y=[0, hi], mode="lines", name="y = x", line={"color": "#888", "dash": "dot"},
                   hoverinfo="skip")
    )
    fig.add_trace(
        go.Scatter(
            x=[m for _, m, _ in pairs], y=[p for _, _, p in pairs], mode="markers",
            name="passed attempts", marker={"size": 10, "color": CATEGORY_COLORS["passed"]},
            hovertext=[f"{_hover(r)}<br>predicted {p:.2f} GiB<br>error {e:.1f}%"
                       for (r, _, p), e in zip(pairs, errors)],
            hoverinfo="text",
        )
    )
    fig.update_layout(
        title=f"Predicted vs measured peak memory (median |error| {median_error:.1f}%)",
        xaxis_title=f"measured: {memory_label}", yaxis_title="predicted peak memory (GiB)", height=480,
    )
    return fig, median_error


def failures_and_pruned(failed: Counter[str], pruned: Counter[str]) -> go.Figure | None:
    """Two bar charts side by side: launched attempts that failed, by kind; layouts refused before launch, by kind."""
    panels = [(title, counts, CATEGORY_COLORS[key]) for title, counts, key in (
        ("Failed attempts by kind", failed, "failed"), ("Pruned layouts by reason kind", pruned, "pruned"))
        if counts]  # a side with nothing to count is left out, not drawn empty
    if not panels:
        return None
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[title for title, _, _ in panels])
    for col, (_, counts, color) in enumerate(panels, start=1):
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        fig.add_trace(
            go.Bar(x=[html.escape(k) for k, _ in ordered], y=[v for _, v in ordered], marker_color=color,
                   showlegend=False, hovertemplate="%{x}: %{y}<extra></extra>"),
            row=1, col=col,
        )
    fig.update_yaxes(title_text="count", row=1, col=1)
    fig.update_layout(height=400, margin={"t": 60})
    return fig


def _axis_value(row: TrialRow, axis: str) -> Any:
    if row.built is not None:
        return AXIS[axis].value(row.built)
    return row.layout.get(axis)


def _order_key(axis: str, value: Any) -> tuple[Any, ...]:
    # Numbers sort numerically and precisions/recompute by cost, so the boxes read left to right as "more of it".
    if axis == "recompute" and isinstance(value, str):  # selective:<modules> sorts after plain selective
        granularity = value.partition(":")[0]
        if granularity in RECOMPUTES:
            return (0, RECOMPUTES.index(granularity), value)
    if axis == "precision" and value in PRECISIONS:
        return (0, PRECISIONS.index(value))
    if isinstance(value, (bool, int, float)):
        return (0, float(value))
    return (1, str(value))


def axis_effects(rows: Sequence[TrialRow]) -> go.Figure | None:
    """Tokens/s by value for every axis that took more than one value among passed explore-phase attempts.

    Confirmation runs are left out: they run more steps, so their throughput is not comparable one-for-one.
    """
    passed = [r for r in rows if r.category in ("passed", "not stable") and r.phase != "confirm"
              and r.tokens_per_s is not None]
    varied: list[tuple[str, list[Any]]] = []
    for axis in EFFECT_AXES:
        values = sorted({_axis_value(r, axis) for r in passed if _axis_value(r, axis) is not None},
                        key=lambda v: _order_key(axis, v))
        if len(values) > 1:
            varied.append((axis, values))
    if not varied:
        return None
    cols = min(3, len(varied))
    n_rows = math.ceil(len(varied) / cols)
    fig = make_subplots(rows=n_rows, cols=cols, subplot_titles=[axis for axis, _ in varied],
                        vertical_spacing=0.5 / n_rows if n_rows > 1 else 0.1)
    for i, (axis, values) in enumerate(varied):
        row_i, col_i = i // cols + 1, i % cols + 1
        members = [r for r in passed if _axis_value(r, axis) is not None]
        fig.add_trace(
            go.Box(
                x=[str(_axis_value(r, axis)) for r in members], y=[r.tokens_per_s for r in members],
                boxpoints="all", jitter=0.4, pointpos=0, showlegend=False, name=axis,
                marker={"color": CATEGORY_COLORS["passed"]}, hovertext=[_hover(r) for r in members], hoverinfo="text",
            ),
            row=row_i, col=col_i,
        )
        fig.update_xaxes(type="category", categoryorder="array", categoryarray=[str(v) for v in values],
                         row=row_i, col=col_i)
        if col_i == 1:
            fig.update_yaxes(title_text="tokens/s", row=row_i, col=col_i)
    fig.update_layout(height=max(320, 300 * n_rows), margin={"t": 50})
    return fig


# -- HTML tables and figure embedding --------------------------------------------------------------------------------
def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def num(value: float | None, fmt: str = "{:,.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def html_table(headers: list[str], body: list[list[str]], cls: str = "") -> str:
    """An HTML table; cells must already be escaped (some carry markup such as links)."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    rows = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in body)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'


class FigureHtml:
    """Turns figures into divs, inlining plotly.js with the first one only so the page carries it once."""

    def __init__(self) -> None:
        self.first = True

    def div(self, fig: go.Figure | None, empty: str) -> str:
        if fig is None:
            return f'<p class="note">{esc(empty)}</p>'
        out = pio.to_html(fig, full_html=False, include_plotlyjs=self.first,
                          config={"displaylogo": False, "responsive": True})
        self.first = False
        return out


def kind_counts(rows: Sequence[TrialRow], category: str) -> Counter[str]:
    """Attempts of one category (failed / pruned) counted by failure kind, most common first."""
    missing = "unspecified" if category == "pruned" else "unknown"
    return Counter(r.result.failure_kind or missing for r in rows if r.category == category)


def counts_table(rows: Sequence[TrialRow]) -> str:
    """Launched / passed / over-headroom / failed by kind / pruned by kind / confirmation counts."""
    explore = [r for r in rows if r.phase != "confirm"]
    confirm = [r for r in rows if r.phase == "confirm"]
    launched = [r for r in explore if r.category != "pruned"]
    failed, pruned = kind_counts(rows, "failed"), kind_counts(rows, "pruned")
    attempts_per_trial = Counter(r.number for r in launched)
    retried = sum(1 for n in attempts_per_trial.values() if n > 1)

    def by_kind(counts: Counter[str]) -> str:
        return ", ".join(f"{esc(k)} {v}" for k, v in counts.most_common()) or "–"

    body = [
        ["Launched", f"{len({r.number for r in launched})} trials ({len(launched)} attempts, {retried} retried)"],
        ["Passed (stable)", str(sum(r.category == "passed" for r in explore))],
        ["Passed, over the memory headroom", str(sum(r.category == "not stable" for r in explore))],
        ["Failed attempts", f"{sum(failed.values())}: {by_kind(failed)}"],
        ["Pruned before launch", f"{sum(pruned.values())}: {by_kind(pruned)}"],
        ["Confirmation runs", f"{sum(r.category == 'passed' for r in confirm)} passed of {len(confirm)}"],
    ]
    return html_table(["", "count"], body, cls="counts")


def pruned_reasons_table(rows: Sequence[TrialRow], top: int = 10) -> str:
    """Pruned reasons grouped with their numbers masked, so 'tp=4 does not divide 6' and 'tp=8 …' count together."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r.category == "pruned":
            reason = (r.result.error or "no reason recorded").strip()
            groups.setdefault(re.sub(r"\d+(?:\.\d+)?", "N", reason), []).append(reason)
    if not groups:
        return '<p class="note">No layout was pruned.</p>'
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:top]
    body = [[esc(pattern), str(len(examples)), esc(examples[0])] for pattern, examples in ordered]
    return "<h3>Top pruned reasons</h3>" + html_table(["reason (numbers masked)", "count", "example"], body)


def memory_pruned_table(pruned: Sequence[dict[str, Any]]) -> str:
    """The layouts a sweep never launched because of memory: prediction, the estimator's error band, the reason
    (sweep.json ``memory_pruned``, written by the sweep as it re-assesses the space)."""
    if not pruned:
        return '<p class="note">No valid layout was pruned on predicted memory.</p>'
    body = []
    for p in pruned:
        band = p.get("memory_band_gib") or [None, None]
        body.append([esc(str(p.get("layout"))), num(p.get("memory_gib"), "{:.1f}"),
                     f"{num(band[0], '{:.1f}')}-{num(band[1], '{:.1f}')}", esc(str(p.get("reason", "")))])
    table = html_table(["layout", "predicted GiB", "error band GiB", "reason"], body)
    return (f"<details><summary>{len(pruned)} valid layouts pruned on predicted memory (prediction, band, reason)"
            f"</summary>{table}</details>")


def dominated_table(dominated: Sequence[dict[str, Any]], stopped_early: str | None, measured: str = "measured") -> str:
    """The layouts a measured trial made not worth running (sweep.json ``dominated``), and why exploring stopped
    early (``stopped_early``), when it did. ``measured``: what the trials' figures were ("modelled" in a rehearsal)."""
    parts = [f'<p class="caveat">{esc(stopped_early)}</p>'] if stopped_early else []
    if dominated:
        body = [[esc(str(d.get("layout"))), esc(str(d.get("reason", "")))] for d in dominated]
        parts.append(f"<details><summary>{len(dominated)} layouts dominated by a {measured} trial (never run)"
                     f"</summary>{html_table(['layout', 'reason'], body)}</details>")
    return "".join(parts)


def unsupported_table(unsupported: Sequence[dict[str, Any]]) -> str:
    """The valid layouts the backend cannot run (sweep.json ``unsupported``): never proposed, never a pass."""
    if not unsupported:
        return ""
    body = [[esc(str(u.get("layout"))), esc(str(u.get("reason", "")))] for u in unsupported]
    return (f"<details><summary>{len(unsupported)} valid layouts this backend cannot run (never launched)"
            f"</summary>{html_table(['layout', 'reason'], body)}</details>")


def mlflow_run_url(mlflow: dict[str, Any], run_id: str | None) -> str | None:
    """The MLflow UI page of a run when the sweep logged to a tracking server (http/https); None for a local
    store, which has no address to link to."""
    uri, experiment = str(mlflow.get("tracking_uri") or ""), mlflow.get("experiment_id")
    if not run_id or experiment is None or not uri.startswith(("http://", "https://")):
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"


def _run_cell(mlflow: dict[str, Any], run_id: str | None) -> str:
    url = mlflow_run_url(mlflow, run_id)
    return f'<a href="{esc(url)}">{esc(run_id)}</a>' if url else esc(run_id or "–")


def attempts_table(rows: Sequence[TrialRow], mlflow: dict[str, Any] | None = None) -> str:
    """Every attempt in trial order (explore before confirm), user text escaped, long errors cut to a tooltip;
    MLflow run ids link to the run when the sweep logged to a tracking server."""
    ordered = sorted(rows, key=lambda r: (r.number, r.phase == "confirm", r.attempt))
    body = []
    for r in ordered:
        error = (r.result.error or "").strip()
        short = error if len(error) <= _ERROR_CHARS else error[: _ERROR_CHARS - 1] + "…"
        layout_title = r.built.to_string() if r.built is not None else json.dumps(r.layout)
        m = r.result.metrics
        body.append([
            str(r.number), str(r.attempt), esc(r.phase),
            f'<span title="{esc(layout_title)}">{esc(r.name)}</span>',
            f'<span class="cat" style="background:{CATEGORY_COLORS[r.category]}">{esc(r.category)}</span>',
            esc(r.result.failure_kind or ""),
            f'<span class="err" title="{esc(error)}">{esc(short)}</span>',
            num(r.tokens_per_s, "{:,.0f}"), num(m.tflops_per_gpu),
            num(r.peak_memory_gib, "{:.2f}"), num(r.predicted_memory_gib, "{:.2f}"),
            *(num(value, "{:.2f}") for value in (m.checkpoint_save_s, m.checkpoint_load_s, m.checkpoint_save_host_gib)),
            _checkpoint_disk_cell(r), num(m.stress_peak_memory_gib, "{:.2f}"),
            num(r.duration_s, "{:.0f}"), _run_cell(mlflow or {}, r.mlflow_run_id),
        ])
    headers = ["#", "attempt", "phase", "layout", "status", "failure", "error", "tokens/s", "TFLOP/s/GPU",
               "peak mem (GiB)", "predicted (GiB)", "ckpt save (s)", "ckpt load (s)", "ckpt save host (GiB)",
               "ckpt on disk (GiB)", "stress peak (GiB)", "time (s)", "MLflow run"]
    return html_table(headers, body, cls="attempts")


def _checkpoint_disk_cell(row: TrialRow) -> str:
    """The trial's checkpoint folder in GiB (issue 43), and whether the trial deleted it after its reload."""
    size = row.result.checkpoint_bytes
    if size is None:
        return "–"
    deleted = ' <span class="dim">deleted</span>' if row.result.checkpoint_deleted else ""
    return f"{size / GIB:.2f}{deleted}"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1400px;padding:0 1rem;
color:#222}
h1{font-size:1.6rem}h2{margin-top:2.2rem;border-bottom:1px solid #ddd}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.25rem 1rem}dt{font-weight:600}dd{margin:0}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
th,td{border:1px solid #ddd;padding:.25rem .5rem;text-align:left;vertical-align:top}th{background:#f4f4f4}
table.attempts td:nth-child(n+8){text-align:right;white-space:nowrap}
.err{font-family:ui-monospace,monospace;font-size:.8rem;word-break:break-word}
.cat{color:#fff;padding:0 .4rem;border-radius:3px;white-space:nowrap}
.caveat{background:#fff6e0;border-left:4px solid #e9a23b;padding:.5rem .75rem}
.rehearsal{background:#f3e8ff;border:2px solid #8b3fd9;padding:.75rem 1rem;font-size:1.05rem}
.good{font-size:1.1rem}.bad{color:#a0202f;font-weight:600}.note,.dim{color:#666}
pre{background:#f6f6f6;padding:.5rem;white-space:pre-wrap}
"""
