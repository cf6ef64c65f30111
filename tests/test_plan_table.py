"""`sweeper plan`'s table (issue 43): ranked as the sweep ranks layouts, names that never wrap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_plan_table_ranks_by_the_production_objective_and_never_folds_a_layout_name() -> None:
    proc = subprocess.run([sys.executable, "-m", "sweeper", "plan", "nemotron"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "as a 16-GPU production run would run each" in proc.stdout
    layouts_table = proc.stdout.split("invalid layouts by reason")[0]
    rows = [line.split("│") for line in layouts_table.splitlines() if line.startswith("│")]
    # A folded name continues on a row of its own with empty number cells: every row is one whole layout.
    assert rows and all(cells[1].strip().startswith("TP") and cells[2].strip().isdigit() for cells in rows), rows[:3]
    production = [float(cells[-2].strip().replace(",", "")) for cells in rows]
    fits = [cells[7].strip() for cells in rows]
    launchable = [p for p, f in zip(production, fits) if f != "no"]
    assert launchable == sorted(launchable, reverse=True)
