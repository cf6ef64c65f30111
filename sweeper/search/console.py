"""What a sweep says, and where: the terminal gets sweeper's own lines; ``sweep.log`` in the sweep folder gets
those and everything else (Optuna, MLflow, Alembic, Ray, Python warnings), time-stamped.

Verbosity (``search -v`` / ``-q``): normal shows sweeper's lines; ``-q`` only warnings, failures and the result;
``-v`` also the libraries' INFO lines on the terminal. The libraries that attach their own terminal handlers at
import (Optuna, MLflow) are made to propagate to the root logger instead (``quiet_libraries``), so that their lines
reach the log file and the terminal only as the verbosity says.

A terminal gets a live table of the running trials (``Display``, drawn by ``sweeper.ui``); a pipe or a file gets
plain progress lines.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal, Protocol

from rich.console import Console
from rich.text import Text

Verbosity = Literal["quiet", "normal", "verbose"]
LOG_FILE = "sweep.log"
_log = logging.getLogger("sweeper")
# Loggers that carry a terminal handler of their own once imported; their lines belong in the log file.
LIBRARY_LOGGERS = ("optuna", "mlflow", "alembic", "ray", "urllib3", "py.warnings")


class Display(Protocol):
    """A live view of the running trials (the CLI passes one on a terminal)."""

    def update(self, running: list[dict[str, Any]], progress: str) -> None: ...

    def stop(self) -> None: ...


class _Terminal(Console):
    """rich's Console, except that a closed pipe raises BrokenPipeError (rich's own answer exits the process:
    SystemExit(1), from wherever the line was printed)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError("the terminal's reader has gone")


class SweepConsole:
    """sweeper's lines (rich markup) to the terminal at the chosen verbosity, and to the ``sweeper`` logger."""

    def __init__(self, file: IO[str] | None = None) -> None:
        # stderr unless given a stream; a long line stays one line in a pipe or a log
        self.terminal = _Terminal(file=file, stderr=file is None, soft_wrap=True)
        self.verbosity: Verbosity = "normal"
        self.display: Display | None = None
        self.terminal_gone = False

    def print(self, markup: str, *, important: bool = False) -> None:
        """One line. ``important`` lines (warnings, failures, the result) are shown even with ``-q``."""
        _log.info(Text.from_markup(markup).plain)
        if self.verbosity != "quiet" or important:
            self._to_terminal(markup)

    def _to_terminal(self, markup: str) -> None:
        """A line on the terminal while there is one. A closed one (the pipe's reader gone, the terminal hung up)
        stops the terminal output, not the sweep: its lines still reach sweep.log. Raised here, the error would
        surface wherever the line was printed, a signal handler included, and leave the sweep's records
        unfinished (seen: sweep.json left ``running`` after a SIGINT whose line met a closed pipe)."""
        if self.terminal_gone:
            return
        try:
            self.terminal.print(markup)
        except OSError as exc:  # BrokenPipeError, EIO of a hung-up terminal
            self.terminal_gone = True
            _log.warning("terminal output stopped (%s); sweep.log has every line", exc)

    def progress(self, markup: str, running: list[dict[str, Any]], line: bool = True) -> None:
        """The progress summary: the live view on a terminal; otherwise, with ``line``, a plain line (also the
        one written to the log)."""
        if self.display is not None:
            self.display.update(running, markup)
        if not line:
            return
        _log.info(Text.from_markup(markup).plain)
        if self.display is None and self.verbosity != "quiet":
            self._to_terminal(markup)


console = SweepConsole()


def quiet_libraries() -> None:
    """Optuna's and MLflow's own terminal handlers removed; their records propagate to the root logger."""
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True


@contextlib.contextmanager
def sweep_log(folder: Path, verbosity: Verbosity, display: Display | None) -> Iterator[Path]:
    """For the sweep's duration: every record to ``folder/sweep.log`` (appended: a resumed sweep continues it),
    library lines on the terminal only with ``-v``, Python warnings captured as log records."""
    path = folder / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_file.setLevel(logging.DEBUG if verbosity == "verbose" else logging.INFO)
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    # The terminal shows library records with -v only; sweeper's own lines reach it through SweepConsole.
    to_terminal.addFilter(lambda record: verbosity == "verbose" and not record.name.startswith("sweeper"))
    root = logging.getLogger()
    previous_level = root.level
    root.setLevel(logging.DEBUG if verbosity == "verbose" else logging.INFO)
    root.addHandler(to_file)
    root.addHandler(to_terminal)
    quiet_libraries()
    logging.captureWarnings(True)
    console.verbosity, console.display = verbosity, display
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # each warning once per place, as a log record (captureWarnings)
            yield path
    finally:
        if display is not None:
            display.stop()
        console.display = None
        logging.captureWarnings(False)
        root.removeHandler(to_file)
        root.removeHandler(to_terminal)
        root.setLevel(previous_level)
        to_file.close()
