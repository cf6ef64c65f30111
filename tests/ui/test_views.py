"""Terminal views: the doctor table shows one row per node with every column the report gives."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from sweeper.ui import views


def test_doctor_table_has_a_row_per_node_and_flags_disagreement(monkeypatch) -> None:
    console = Console(record=True, width=200)
    monkeypatch.setattr(views, "console", console)
    rows = [{"node": "sim-0", "torch": "2.13.0", "paths": "ok"}, {"node": "sim-1", "torch": "2.9.1 !", "paths": "ok"}]
    report = SimpleNamespace(rows=lambda: rows, problems=["sim-1: torch 2.9.1 differs"], ok=False, warnings=[])
    views.print_doctor(report)
    text = console.export_text()
    assert "sim-0" in text and "sim-1" in text and "2.9.1 !" in text
    assert "node" in text.splitlines()[1] or any("node" in line and "torch" in line for line in text.splitlines())
    assert "problem: sim-1: torch 2.9.1 differs" in text
    assert "nodes disagree" in text


def test_doctor_warnings_are_shown_and_the_nodes_still_agree(monkeypatch) -> None:
    """Issue 51: a node whose GPUs are logical runs (on the CPU); doctor says so without calling it a disagreement."""
    console = Console(record=True, width=200)
    monkeypatch.setattr(views, "console", console)
    report = SimpleNamespace(rows=lambda: [{"node": "127.0.0.1"}], problems=[], ok=True,
                             warnings=["127.0.0.1: Ray schedules 4 GPUs here but the node shows none"])
    views.print_doctor(report)
    text = console.export_text()
    assert "warning: 127.0.0.1: Ray schedules 4 GPUs here but the node shows none" in text
    assert "all nodes agree (see the warnings)" in text
