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
