"""Where a sweep's lines go: sweeper's to the terminal at the chosen verbosity, everything to sweep.log."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import optuna
import pytest

from sweeper.search.console import LOG_FILE, console, sweep_log


class Recorder:
    """A Display that keeps what it was shown (stand-in for the rich live table)."""

    def __init__(self) -> None:
        self.updates: list[tuple[int, str]] = []
        self.stopped = False

    def update(self, running: list[dict[str, Any]], progress: str) -> None:
        self.updates.append((len(running), progress))

    def stop(self) -> None:
        self.stopped = True


def _say_everything() -> None:
    console.print("[cyan]launch[/] #1.1 explore TP2")
    console.print("[red]failed[/] #2.1 oom", important=True)
    optuna.logging.get_logger("optuna.study").info("Trial with params {...} already exists. Skipping enqueue.")
    logging.getLogger("mlflow.store.db.utils").info("Updating database tables")
    warnings.warn("Argument group is an experimental feature", UserWarning, stacklevel=1)
    console.progress("[dim]0m05s | running 1[/]", [{"trial": "1.1"}])


def test_the_terminal_gets_sweepers_lines_and_the_log_gets_everything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with sweep_log(tmp_path, "normal", None) as path:
        _say_everything()
    err = capsys.readouterr().err
    assert "launch #1.1 explore TP2" in err and "failed #2.1 oom" in err and "0m05s | running 1" in err
    assert "already exists" not in err and "Updating database tables" not in err and "experimental" not in err
    log = path.read_text()
    assert path == tmp_path / LOG_FILE
    for text in ("launch #1.1 explore TP2", "failed #2.1 oom", "already exists. Skipping enqueue",
                 "Updating database tables", "experimental feature", "0m05s | running 1"):
        assert text in log, text
    assert "[cyan]" not in log  # markup is for the terminal


def test_quiet_shows_only_what_matters_and_verbose_shows_the_libraries_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with sweep_log(tmp_path / "q", "quiet", None):
        _say_everything()
    quiet = capsys.readouterr().err
    assert "failed #2.1 oom" in quiet and "launch" not in quiet and "running 1" not in quiet
    with sweep_log(tmp_path / "v", "verbose", None):
        _say_everything()
    verbose = capsys.readouterr().err
    assert "launch #1.1" in verbose and "Skipping enqueue" in verbose and "Updating database tables" in verbose


def test_a_terminal_display_gets_the_progress_and_is_stopped_at_the_end(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    display = Recorder()
    with sweep_log(tmp_path, "normal", display):
        _say_everything()
    assert display.updates == [(1, "[dim]0m05s | running 1[/]")] and display.stopped
    assert "running 1" not in capsys.readouterr().err  # drawn by the display, not printed as a line
    assert console.display is None


def test_a_refresh_moves_the_display_on_without_a_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    display = Recorder()
    with sweep_log(tmp_path, "normal", display) as path:
        console.progress("[dim]0m10s | running 2[/]", [{"trial": "1.1"}, {"trial": "2.1"}], line=False)
    assert display.updates == [(2, "[dim]0m10s | running 2[/]")]
    assert "running 2" not in capsys.readouterr().err and "running 2" not in path.read_text()


def test_the_live_table_shows_each_running_trial() -> None:
    from io import StringIO

    from rich.console import Console

    from sweeper.ui.live import LiveTrials

    terminal = Console(file=StringIO(), force_terminal=True, width=120, record=True)
    live = LiveTrials(terminal)
    live.update([{"trial": "3.1", "phase": "explore", "layout": "TP2-PP1-EP2", "gpus": 4, "nodes": "n0,n1",
                  "elapsed_s": 75.0}], "[dim]1m15s | running 1[/]")
    live.live.refresh()
    live.stop()
    text = terminal.export_text()
    assert "running trials (1)" in text and "TP2-PP1-EP2" in text and "n0,n1" in text and "1m15s" in text


class _ClosedPipe:
    """A stream whose reader has gone (stand-in for the pipe of a parent that was killed)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_terminal_stops_the_terminal_lines_not_the_sweep(tmp_path: Path) -> None:
    from sweeper.search.console import SweepConsole

    closed = SweepConsole(file=_ClosedPipe())  # type: ignore[arg-type]
    with sweep_log(tmp_path, "normal", None):
        # rich ended the process here before (SystemExit from its broken-pipe handler), in a signal handler too
        closed.print("[yellow]SIGINT: stopping launches[/]", important=True)
        closed.progress("[dim]0m05s | running 1[/]", [])
        closed.print("best stable layout: TP2", important=True)
    assert closed.terminal_gone
    log = (tmp_path / LOG_FILE).read_text()
    assert "SIGINT: stopping launches" in log and "best stable layout: TP2" in log and "0m05s | running 1" in log
    assert "terminal output stopped" in log
