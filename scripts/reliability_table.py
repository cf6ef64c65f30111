"""Run the fault tests (tests/search/test_faults.py: real sweeps on simulated Ray clusters with injected faults) and
print docs/reliability.md's table from what each test observed.

    python scripts/reliability_table.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.jsonl"
        started = time.monotonic()
        proc = subprocess.run(
            # Every scenario, those CI leaves to `-m slow` included (a later -m replaces the default one).
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
             str(ROOT / "tests" / "search" / "test_faults.py")],
            cwd=ROOT, env={**os.environ, "SWEEPER_FAULT_REPORT": str(report)},
        )
        rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    elapsed = time.monotonic() - started
    print(f"\n{len(rows)} fault scenarios passed in {elapsed:.0f} s (pytest exit {proc.returncode})\n")
    print("| fault | what happens | what is kept |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['fault']} | {row['happened']} | {row['kept']} |")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
