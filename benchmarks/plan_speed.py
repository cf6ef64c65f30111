"""How long `python -m sweeper plan SPACE --json` takes, interpreter start-up included, against its budget.

Runs each search space as a fresh subprocess several times (the user's experience: a cold command) and prints
the median wall time, the number of layouts (and how many are valid), and the ratio to the budget: 1 s for the
11,520-layout Nemotron space of issue 15 (benchmarks/spaces/nemotron_wide.yaml), 2 s for the others.
``--check`` exits 1 when a median is over budget, so CI can run it as a gate. ``--against CHECKOUT`` times the
same command from another checkout of sweeper too (its package first on PYTHONPATH), the runs interleaved so both
see the same host load, and prints the ratio: before and after a change, in one run (issue 54), with a check that
both print the same plan.

    python benchmarks/plan_speed.py [--runs 5] [--check] [--against /work/main] [--set ITEM ...] [SPACE.yaml ...]

``--set`` passes the command's own overrides to every run: the 99,360-layout space of issue 54's "100k layouts in
under 2 s" is DeepSeek-V3's with one precision, ``search_spaces/deepseek_v3_1024.yaml --set 'space.precision=[fp8]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDE = ROOT / "benchmarks" / "spaces" / "nemotron_wide.yaml"
DEFAULT_SPACES = [WIDE, ROOT / "search_spaces" / "nemotron.yaml", ROOT / "search_spaces" / "deepseek_v2_lite.yaml"]
BUDGET_S = {WIDE.name: 1.0}  # issue 15
DEFAULT_BUDGET_S = 2.0


CPU_S: dict[Path, list[float]] = {}  # by checkout: each plan's CPU seconds (user + system), steadier than wall on a
# shared host


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_plan(space: Path, checkout: Path, overrides: list[str]) -> tuple[float, str]:
    """One cold ``plan --json`` of ``space`` (``overrides``: its ``--set`` items) by ``checkout``'s sweeper: wall
    seconds and its stdout."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    sets = [arg for item in overrides for arg in ("--set", item)]
    # stdout to a file, as `plan --json > plan.json` writes it, read once the clock has stopped: through a pipe this
    # process would read and decode the tens of MB while the command runs, on the same cores as the command's
    # workers (sweeper/plan/shards.py)
    with tempfile.TemporaryFile() as out:
        start, cpu = time.perf_counter(), _children_cpu()
        proc = subprocess.run([sys.executable, "-m", "sweeper", "plan", str(space.resolve()), "--json", *sets],
                              cwd=checkout, stdout=out, stderr=subprocess.PIPE, text=True, check=False, env=env)
        wall = time.perf_counter() - start
        CPU_S.setdefault(checkout, []).append(_children_cpu() - cpu)
        out.seek(0)
        text = out.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"{space.name}: plan exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return wall, text


def time_plan(space: Path, runs: int, against: Path | None = None, overrides: list[str] | None = None,
              ) -> tuple[float, list[float], list[dict], list[float]]:
    """Median wall, the walls and the entries of this checkout's plan; ``against``'s walls (interleaved runs)."""
    walls: list[float] = []
    other: list[float] = []
    out = ""
    for _ in range(runs):
        wall, out = run_plan(space, ROOT, overrides or [])
        walls.append(wall)
        if against is not None:
            wall, theirs = run_plan(space, against, overrides or [])
            other.append(wall)
            if theirs != out and json.loads(theirs) != json.loads(out):  # the same values, whatever the spacing
                raise SystemExit(f"{space.name}: {against} prints another plan than {ROOT}")
    return statistics.median(walls), walls, json.loads(out), other


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spaces", nargs="*", type=Path, default=DEFAULT_SPACES)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="exit 1 when a median exceeds the budget")
    parser.add_argument("--against", type=Path, help="another sweeper checkout to time the same plans with")
    parser.add_argument("--set", action="append", default=[], metavar="ITEM",
                        help="an override of every space's YAML, as the command's --set (repeatable)")
    args = parser.parse_args()

    over = False
    print(f"{'space':<24} {'median s':>9} {'min s':>7} {'max s':>7} {'layouts':>8} {'valid':>6} {'x budget':>9}")
    for space in args.spaces:
        median, walls, entries, other = time_plan(space, args.runs, args.against, args.set)
        valid = sum(1 for e in entries if e["valid"])
        ratio = median / BUDGET_S.get(space.name, DEFAULT_BUDGET_S)
        over |= ratio > 1
        print(
            f"{space.name:<24} {median:>9.2f} {min(walls):>7.2f} {max(walls):>7.2f} {len(entries):>8} {valid:>6} "
            f"{ratio:>8.2f}x"
        )
        ours_cpu = statistics.median(CPU_S.pop(ROOT))
        print(f"  CPU (user + system): median {ours_cpu:.2f} s")
        if other:
            theirs = statistics.median(other)
            theirs_cpu = statistics.median(CPU_S.pop(args.against))
            print(f"  {args.against}: median {theirs:.2f} s (min {min(other):.2f}, max {max(other):.2f}), CPU "
                  f"{theirs_cpu:.2f} s; the same plan: this checkout takes {median / theirs:.2f}x its wall time, "
                  f"{ours_cpu / theirs_cpu:.2f}x its CPU")
    print(f"budget: {DEFAULT_BUDGET_S:.1f} s per plan ({', '.join(f'{k} {v:.1f} s' for k, v in BUDGET_S.items())}), "
          f"interpreter start-up included ({args.runs} runs each, median)")
    return 1 if (over and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
