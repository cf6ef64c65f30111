"""How well a sweep keeps the cluster busy when its layouts have mixed sizes (issue 15, packing).

Reads a sweep folder (``trials.jsonl``, ``sweep.json``), or first runs one: the quickstart space (2- and 4-GPU
layouts of tiny-moe on a simulated 2 x 2 cluster, real trials). Prints, all measured in that sweep:
  - scheduling efficiency: GPU-seconds held by trials / GPU-seconds the cluster offered while the sweep ran
    (``sweep.json`` ``scheduling_efficiency``: the driver's own count), and the same from the trial records
    over the exploring phase only (the span from the first trial's start to the last explore trial's end);
  - concurrency: the time-weighted mean number of trials running, and the share of the exploring phase in
    which at least two trials ran, against the share in which the free GPUs would have allowed two (when the
    running trials left room for the smallest layout of the space).

    python benchmarks/packing.py [SWEEP_DIR] [--max-trials 12]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPACE = ROOT / "search_spaces" / "quickstart.yaml"


def _t(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def analyse(sweep: Path) -> dict:
    meta = json.loads((sweep / "sweep.json").read_text())
    records = [json.loads(line) for line in (sweep / "trials.jsonl").read_text().splitlines() if line.strip()]
    ran = [r for r in records if r.get("started_at") and r.get("ended_at") and r["attempt"] >= 1]
    explore = [r for r in ran if r.get("phase", "explore") == "explore"]
    if not explore:
        raise SystemExit(f"{sweep}: no explored trial with start and end times")
    cluster = meta["cluster"]
    gpus = cluster["nodes"] * cluster["gpus_per_node"]
    smallest = min(r["layout"]["gpus"] for r in explore)
    t0 = min(_t(r["started_at"]) for r in explore)
    t1 = max(_t(r["ended_at"]) for r in explore)
    events = sorted({t0, t1, *(_t(r["started_at"]) for r in explore), *(_t(r["ended_at"]) for r in explore)})
    busy = two = room_for_two = weighted = 0.0
    for a, b in zip(events, events[1:]):
        if b <= t0 or a >= t1:
            continue
        running = [r for r in explore if _t(r["started_at"]) <= a and _t(r["ended_at"]) >= b]
        used = sum(r["layout"]["gpus"] for r in running)
        span = b - a
        busy += used * span
        weighted += len(running) * span
        two += span if len(running) >= 2 else 0.0
        # Two trials were possible here: one runs and the rest of the cluster holds the smallest layout too.
        room_for_two += span if (len(running) >= 2 or (running and gpus - used >= smallest)) else 0.0
    wall = t1 - t0
    return {
        "sweep": str(sweep), "trials": len(explore), "gpus": gpus,
        "sizes": sorted({r["layout"]["gpus"] for r in explore}),
        "scheduling_efficiency_driver": meta.get("scheduling_efficiency"),
        "scheduling_efficiency_explore": busy / (gpus * wall) if wall > 0 else None,
        "mean_concurrent": weighted / wall if wall > 0 else None,
        "share_two_running": two / wall if wall > 0 else None,
        "share_room_for_two": room_for_two / wall if wall > 0 else None,
        "explore_wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", nargs="?", type=Path)
    parser.add_argument("--max-trials", type=int, default=12)
    args = parser.parse_args()
    sweep = args.sweep
    if sweep is None:
        sweep = Path(tempfile.mkdtemp(prefix="sweeper-packing-")) / "sweep"
        cmd = [sys.executable, "-m", "sweeper", "search", str(SPACE), "--out", str(sweep),
               "--max-trials", str(args.max_trials)]
        log = sweep.parent / "search.log"
        print("running:", " ".join(cmd), f"(console in {log})", flush=True)
        with log.open("w") as out:
            subprocess.run(cmd, cwd=ROOT, check=False, stdout=out, stderr=subprocess.STDOUT)
    out = analyse(sweep)
    print(f"{out['sweep']}: {out['trials']} explored trials of sizes {out['sizes']} on {out['gpus']} GPUs, "
          f"exploring for {out['explore_wall_s']:.0f} s")
    driver = out["scheduling_efficiency_driver"]
    print(f"  scheduling efficiency (driver, whole sweep incl. reference and confirmation): "
          f"{driver:.2f}" if driver is not None else "  scheduling efficiency (driver): not recorded")
    print(f"  scheduling efficiency (exploring phase, from the trial records): "
          f"{out['scheduling_efficiency_explore']:.2f}")
    print(f"  mean trials running: {out['mean_concurrent']:.2f}")
    print(f"  share of the exploring phase with >= 2 trials running: {out['share_two_running']:.2f} "
          f"(the free GPUs allowed 2 for {out['share_room_for_two']:.2f}; ratio "
          f"{out['share_two_running'] / out['share_room_for_two']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
