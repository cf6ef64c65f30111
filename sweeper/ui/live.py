"""The live table of running trials a sweep shows on a terminal (``search.console.Display``): trial, phase,
layout, GPUs, nodes and elapsed time of each, under the progress summary. Lines the sweep prints scroll above it."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text


class LiveTrials:
    def __init__(self, terminal: Console) -> None:
        self.live = Live(Text(""), console=terminal, refresh_per_second=2, transient=True)
        self.started = False  # started by the first update, so a refused command leaves the terminal alone

    def update(self, running: list[dict[str, Any]], progress: str) -> None:
        table = Table(title=f"running trials ({len(running)})", title_justify="left", expand=False)
        for column in ("trial", "phase", "layout", "GPUs", "nodes", "elapsed"):
            table.add_column(column, justify="right" if column in ("GPUs", "elapsed") else "left")
        for row in running:
            elapsed = int(row["elapsed_s"])
            table.add_row(row["trial"], row["phase"], row["layout"], str(row["gpus"]), row["nodes"],
                          f"{elapsed // 60}m{elapsed % 60:02d}s")
        self.live.update(Group(Text.from_markup(progress), table))
        if not self.started:
            self.live.start()
            self.started = True

    def stop(self) -> None:
        if self.started:
            self.live.stop()
