"""Hundreds of trials in one sweep: does the driver stay flat, and does the report still render in seconds?

Runs ``benchmarks/spaces/long_sweep.yaml`` (332 launchable layouts of the smallest real model, 2 steps each, every
one run: the budget covers the space) on a simulated 2 x 2 cluster and samples, every few seconds while it runs:
  - the driver's resident memory and open file descriptors (psutil);
  - the Ray processes of its simulated cluster (the record it keeps under /tmp/sweeper-clusters names them; warm
    ranks and other actors are children of its raylets) and, every minute, its live placement groups (a short-lived
    read-only client);
  - trials.jsonl and sweep.json, read back whole: a torn line or a half-written JSON file is counted.
Then renders the report again (``sweeper report``) and times it. Prints the first and last quartile of each series
(after a warm-up of the first 10% of the trials) and their ratio, the torn reads, and the report's size and time.

    python scripts/long_sweep.py [--keep DIR]    (about 40 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
SPACE = ROOT / "benchmarks" / "spaces" / "long_sweep.yaml"
RECORDS = Path(tempfile.gettempdir()) / "sweeper-clusters"
SAMPLE_S = 3.0
PLACEMENT_GROUPS_EVERY_S = 60.0
PG_PROBE = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(sum(1 for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"))
"""


def cluster_of(driver: int) -> dict[str, Any] | None:
    for path in RECORDS.glob("cluster-*.json") if RECORDS.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("driver_pid") == driver:
            return record
    return None


def ray_processes(record: dict[str, Any]) -> int:
    """Alive processes of the simulated cluster: its daemons and everything they started (workers, warm ranks)."""
    seen: set[int] = set()
    for pid, _ in record.get("processes", []):
        try:
            proc = psutil.Process(pid)
            seen.add(pid)
            seen.update(child.pid for child in proc.children(recursive=True))
        except psutil.Error:
            continue
    return len(seen)


class PlacementGroups(threading.Thread):
    """Counts the cluster's live placement groups every minute, beside the sampling (a client takes seconds to
    connect on 2 cores); ``errors`` keeps why a probe failed."""

    def __init__(self, address: str, progress: list[int]) -> None:
        super().__init__(daemon=True)
        self.address, self.progress = address, progress
        self.series: list[tuple[int, float]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        while not self.stop.wait(PLACEMENT_GROUPS_EVERY_S):
            try:
                out = subprocess.run([sys.executable, "-c", PG_PROBE, self.address], capture_output=True, text=True,
                                     timeout=120, env=env)
                if out.returncode == 0:
                    self.series.append((self.progress[0], float(out.stdout.strip().splitlines()[-1])))
                else:
                    self.errors.append(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "no output")
            except (subprocess.SubprocessError, ValueError, IndexError) as exc:
                self.errors.append(type(exc).__name__)


def torn(sweep: Path) -> tuple[int, int]:
    """(torn reads, records) of one read of trials.jsonl and sweep.json."""
    bad, records = 0, 0
    trials = sweep / "trials.jsonl"
    if trials.is_file():
        text = trials.read_text()
        for line in text.splitlines():
            try:
                json.loads(line)
                records += 1
            except ValueError:
                bad += 1
        if text and not text.endswith("\n"):
            bad += 1
    meta = sweep / "sweep.json"
    if meta.is_file():
        try:
            json.loads(meta.read_text())
        except ValueError:
            bad += 1
    return bad, records


def quartiles(series: list[tuple[int, float]], total: int) -> tuple[float, float]:
    """Median of the first and of the last quartile of the samples taken after the warm-up (10% of the trials)."""
    after = [v for n, v in series if n >= 0.1 * total]
    q = max(1, len(after) // 4)
    return statistics.median(after[:q]), statistics.median(after[-q:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log = folder / "driver.log"
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "sweeper", "search", str(SPACE), "--out", "sweep", "-q",
             "--set", f"tracking.mlflow_tracking_uri=sqlite:///{folder / 'mlflow.db'}"],
            cwd=folder, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        driver = psutil.Process(proc.pid)
        rss: list[tuple[int, float]] = []
        fds: list[tuple[int, float]] = []
        rays: list[tuple[int, float]] = []
        groups: list[tuple[int, float]] = []
        torn_reads = reads = 0
        records = 0
        progress = [0]  # the records so far, for the placement-group thread
        pgs: PlacementGroups | None = None
        while proc.poll() is None:
            try:
                rss.append((records, driver.memory_info().rss / 2**20))
                fds.append((records, float(driver.num_fds())))
            except psutil.Error:
                break
            bad, records = torn(folder / "sweep")
            progress[0] = records
            torn_reads += bad
            reads += 1
            record = cluster_of(proc.pid)
            if record is not None:
                rays.append((records, float(ray_processes(record))))
                if pgs is None and record.get("address"):
                    pgs = PlacementGroups(record["address"], progress)
                    pgs.start()
            time.sleep(SAMPLE_S)
        if pgs is not None:
            pgs.stop.set()
            groups = pgs.series
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            print(f"the sweep exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            return 1
        bad, total = torn(folder / "sweep")
        launched = sum(1 for line in (folder / "sweep" / "trials.jsonl").read_text().splitlines()
                       if json.loads(line).get("attempt", 0) >= 1)
        t1 = time.perf_counter()
        rendered = subprocess.run([sys.executable, "-m", "sweeper", "report", "sweep"], cwd=folder, env=env,
                                  capture_output=True, text=True)
        render_s = time.perf_counter() - t1
        html = folder / "sweep" / "report.html"
        print(f"{total} records, {launched} launched trials in {wall / 60:.1f} min ({wall / max(launched, 1):.1f} s a "
              f"trial); samples every {SAMPLE_S:g} s after the first 10% of the trials, first vs last quartile:")
        for name, series, unit in (("driver RSS", rss, "MiB"), ("driver open fds", fds, ""),
                                   ("Ray processes", rays, ""), ("placement groups", groups, "")):
            if series:
                first, last = quartiles(series, total)
                print(f"  {name}: {first:.1f} -> {last:.1f} {unit} ({last / first if first else float('nan'):.2f}x)")
        if pgs is not None and pgs.errors:
            print(f"  placement-group probes that failed: {len(pgs.errors)} ({pgs.errors[-1][:200]})")
        print(f"  torn reads of trials.jsonl / sweep.json: {torn_reads} in {reads} reads while it ran, {bad} at the "
              "end")
        print(f"  report: {html.stat().st_size / 2**20:.1f} MiB HTML with all {total} records, rendered in "
              f"{render_s:.1f} s (exit {rendered.returncode})")
        return 0 if rendered.returncode == 0 and torn_reads == 0 and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
