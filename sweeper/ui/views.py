"""Terminal views (rich) of plans, trial results and doctor reports. Presentation only: no decisions here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from sweeper.config.schema import SweepConfig
from sweeper.estimate.disk import disk_plan
from sweeper.record.schema import TrialResult
from sweeper.search.decide.objective import production_gpus
from sweeper.space.layout import Layout

if TYPE_CHECKING:
    from sweeper.search.decide.replan import Replan
    from sweeper.ui.plan_table import PlanTable

console = Console()


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _table_width(table: Table, names: list[str]) -> int:
    """Enough columns for the layout names and the numbers beside them unfolded."""
    return max((len(name) for name in names), default=6) + 14 * (len(table.columns) - 1) + 3 * len(table.columns)


def print_plan(cfg: SweepConfig, plan: PlanTable, limit: int = 40) -> None:
    valid, objectives = plan.valid, plan.objectives
    fits = [e for e in valid if e.predicted and e.predicted.fits]
    maybe = [e for e in valid if e.uncertain]
    c = cfg.cluster
    over = f"{(1 - cfg.search.memory_headroom) * 100:.0f}% memory"
    console.print(
        f"[bold]{cfg.name}[/]: {cfg.model.name} on {c.nodes} x {c.gpus_per_node} GPUs "
        f"({c.gpu_memory_gib:g} GiB, cc {c.compute_capability}); {plan.layouts} layouts: "
        f"[green]{len(fits)} fit[/], [yellow]{len(maybe)} predicted over {over} but inside the estimator's error "
        f"band (a sweep launches them)[/], {len(valid) - len(fits) - len(maybe)} over {over} even at the band's "
        f"lower end, [red]{plan.layouts - len(valid)} invalid[/]"
    )
    n = production_gpus(cfg)
    unit = "tokens/s" if cfg.search.objective == "tokens_per_s" else "rel. per GPU"
    table = Table(title=f"valid layouts, launchable first, best first as a {n}-GPU production run would run each "
                        f"(the sweep's objective, {cfg.search.objective})", show_lines=False)
    shown = valid if limit <= 0 else valid[:limit]
    names = [e.layout.short() for e in shown]
    table.add_column("layout", no_wrap=True, min_width=max((len(name) for name in names), default=6))
    for col in ("GPUs", "DP", "EDP", "mem GiB", "band GiB", "fits", "step s", "tokens/s", f"{n}-GPU {unit}"):
        table.add_column(col, justify="right", no_wrap=True)
    for name, e, objective in zip(names, shown, objectives[:len(shown)], strict=True):
        p = e.predicted
        table.add_row(
            name, str(e.layout.world_size), str(e.layout.dp), str(e.layout.edp),
            _num(p.memory_gib if p else None, "{:.2f}"),
            "-" if p is None else f"{p.memory_band_gib[0]:.1f}-{p.memory_band_gib[1]:.1f}",
            "[green]yes[/]" if p and p.fits else "[yellow]maybe[/]" if e.uncertain else "[red]no[/]",
            _num(p.step_time_s if p else None, "{:.3f}"), _num(p.tokens_per_s if p else None, "{:,.0f}"),
            _num(objective, "{:,.0f}" if unit == "tokens/s" else "{:,.3g}"),
        )
    if valid:
        # Piped (or on a narrow terminal) rich would fold every layout name over several lines: the table keeps
        # its own width and the terminal cuts or wraps whole lines instead.
        wide = Console(width=max(console.width, _table_width(table, names)), force_terminal=console.is_terminal,
                       no_color=console.no_color)
        wide.print(table)
    if len(shown) < len(valid):
        console.print(f"... {len(valid) - len(shown)} more valid layouts (--limit 0 shows all, --json lists them)")
    if valid:
        # The reference is FP32 on a simulated cluster (the CPU backend), the space's first precision on GPUs.
        reference = "fp32" if c.simulate is True else cfg.space.values("precision")[0]
        smallest = min(e.layout.world_size for e in valid)
        console.print(disk_plan(cfg, reference, smallest).line(cfg.training.keep_checkpoints))
    reasons = plan.reasons
    if reasons:
        why = Table(title="invalid layouts by reason")
        why.add_column("layouts", justify="right")
        why.add_column("reason")
        for reason, count in reasons:
            why.add_row(str(count), reason)
        console.print(why)


def print_trial(cfg: SweepConfig, layout: Layout, result: TrialResult) -> None:
    colour = {"passed": "green", "failed": "red", "pruned": "yellow"}[result.status]
    console.print(f"[bold]{layout.short()}[/] on {result.backend}: [{colour}]{result.status}[/]"
                  + (f" ({result.failure_kind}: {result.error})" if result.failure_kind else ""))
    m = result.metrics
    memory = "host RSS" if result.memory_kind == "host" else "device reserved"
    table = Table(show_header=False)
    rows: list[tuple[str, Any]] = [
        ("tokens/s", _num(m.tokens_per_s, "{:,.1f}")),
        ("step time s", _num(m.step_time_s, "{:.3f}")),
        ("TFLOP/s per GPU", _num(m.tflops_per_gpu, "{:.3f}")),
        (f"peak memory GiB ({memory})", _num(m.peak_memory_gib, "{:.2f}")),
        ("loss first -> last", f"{_num(m.loss_first, '{:.4f}')} -> {_num(m.loss_last, '{:.4f}')}"),
        ("checks", ", ".join(f"{k}={v}" for k, v in vars(result.checks).items())),
        ("ranks on nodes", " ".join(result.rank_nodes)),
        ("checkpoint", result.checkpoint or "-"),
        ("checkpoint save / load s", f"{_num(m.checkpoint_save_s, '{:.2f}')} / {_num(m.checkpoint_load_s, '{:.2f}')}"),
        ("checkpoint save host GiB (node, summed)", _num(m.checkpoint_save_host_gib, "{:.2f}")),
        *((f"routing stress {mode}", f"peak {_num(s['peak_memory_gib'], '{:.2f}')} GiB, hot-rank factor "
           f"{_num(s['hot_rank_factor'], '{:.2f}')}, finite {s['finite']}")
          for mode, s in (result.routing_stress or {}).items()),
        ("trial folder", result.trial_dir or "-"),
    ]
    for note in result.notes:
        rows.append(("note", note))
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)


def print_doctor(report: Any) -> None:
    table = Table(title="doctor: every node before any trial")
    rows = report.rows()  # one dict per node; a value differing from the majority ends with '!'
    for col in rows[0] if rows else ["node"]:
        table.add_column(col.replace("_", " "))
    for row in rows:
        table.add_row(*[str(v) for v in row.values()])
    console.print(table)
    for problem in report.problems:
        console.print(f"[red]problem[/]: {problem}")
    for warning in report.warnings:
        console.print(f"[yellow]warning[/]: {warning}")
    if not report.ok:
        console.print("[red]nodes disagree or paths are missing[/]")
    else:
        console.print("[green]all nodes agree[/]" + (" [yellow](see the warnings)[/]" if report.warnings else ""))


def print_migration(migration: Any) -> None:
    """``sweeper migrate`` on a terminal: the verdict, then what changed."""
    from sweeper.space.layout import Layout

    source, target = Layout.from_dict(migration.source).short(), Layout.from_dict(migration.target).short()
    colour = "green" if migration.passed else "red"
    console.print(f"[bold]{source} -> {target}[/]: [{colour}]{migration.status}[/]"
                  + (f" ({migration.failure_kind}: {migration.error})" if migration.failure_kind else ""))
    loads = [t for t in migration.load_s_per_rank if t is not None]
    spread, timeout = migration.load_spread_s, migration.nccl_timeout_s
    table = Table(show_header=False)
    rows: list[tuple[str, Any]] = [
        ("checkpoint", f"{migration.checkpoint or '-'} ({migration.written_by or '-'})"),
        ("tensors resharded", f"{len(migration.resharded)} of {_num(migration.tensors, '{}')}"),
        ("optimizer state", migration.optimizer_state),
        ("load s per rank", " ".join(f"{t:.2f}" for t in loads) or "-"),
        ("load spread s", "-" if spread is None else
         f"{spread:.2f} ({spread / timeout:.2%} of the {timeout:.0f} s NCCL timeout)"),
        ("equivalence rel. error", _num(migration.equivalence_rel_err, "{:.2e}")),
        ("steps after the load", migration.steps_after_load),
    ]
    rows += [("resharded", key) for key in migration.resharded[:12]]
    if len(migration.resharded) > 12:
        rows.append(("resharded", f"... {len(migration.resharded) - 12} more (--json lists all)"))
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)


def print_replan(plan: Replan, top: int = 10) -> None:
    """``sweeper replan``: the layouts at N', best first (every measured one the choice may take, the best
    predicted), what each figure is, and what changed from the sweep's N."""
    from sweeper.search.decide.replan import calibration_line, describe_moves

    folder, n = plan.folder, plan.gpus
    kind = " [magenta](modelled: a rehearsal, not measured)[/]" if folder.rehearsal else ""
    console.print(f"[bold]{folder.cfg.name}[/] replanned from {plan.original_gpus} to [bold]{n}[/] GPUs{kind}: "
                  f"global batch {folder.cfg.training.global_batch_size}, priced with {calibration_line(folder)}")
    shown = plan.rows[:top]
    for extra in (plan.winner, plan.original):
        if extra is not None and extra not in shown:
            shown.append(extra)
    days = folder.cfg.budget is not None
    table = Table(title=f"layouts as a {n}-GPU production run runs them, best first (tokens/s on {n} GPUs)")
    names = [r.layout.short() for r in shown]
    table.add_column("layout on N GPUs", no_wrap=True, min_width=max((len(x) for x in names), default=6))
    for col in ("trial", "figure", "micro-batches", f"tokens/s on {n}", "mem GiB", *(("days",) if days else ())):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("what changed vs the sweep's winner / note")
    lead = plan.original.tokens_per_s if plan.original is not None else None
    for name, row in zip(names, shown, strict=True):
        trial = "-" if row.number is None else f"#{row.number} on {row.trial.world_size}"
        role = ("[green]choice[/] " if row is plan.winner else "") + ("sweep's winner " if row is plan.original
                                                                      else "")
        versus = f"{row.tokens_per_s / lead - 1:+.0%} vs the sweep's winner" if lead and row is not plan.original \
            else ""
        note = row.needs_trial and f"[yellow]needs a trial[/]: {row.needs_trial}"
        text = "; ".join(x for x in (role.strip(), versus, describe_moves(row), *row.notes, note or "") if x)
        figure = row.kind + ("" if row.number is None else (", confirmed" if row.confirmed else ", unconfirmed"))
        table.add_row(name, trial, figure, str(row.microbatches), f"{row.tokens_per_s:,.0f}",
                      f"{row.predicted.memory_gib:.1f}", *((_num(row.days, "{:.1f}"),) if days else ()), text)
    # as print_plan: the table keeps its width where stdout is piped or narrow; the last column wraps
    Console(width=max(console.width, _table_width(table, names) + 40), force_terminal=console.is_terminal,
            no_color=console.no_color).print(table)
    for refused in plan.refused:
        console.print(f"[yellow]cannot run on {n} GPUs[/]: trial #{refused['number']} ({refused['gpus']} GPUs): "
                      f"{refused['reason']}")
    u = plan.unmeasured
    console.print(f"never measured: {u['predicted']} valid production layouts predicted ({u['over_memory']} over the "
                  f"memory limit), {u['launched_not_stable']} left out (the sweep launched them and they were not "
                  f"stable); --json lists the rows shown")
    colour = "yellow" if plan.winner_changed else "green"
    console.print(f"[{colour}]{'the choice changes' if plan.winner_changed else 'the choice stays'}[/]: {plan.why}")
    console.print(f"replanned in {plan.seconds:.2f} s; nothing was written to {folder.root}")
