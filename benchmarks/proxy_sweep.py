"""Wall time of the flagship proxy sweeps, whole and by phase (issue 31: each must end in <= 10 minutes on 2 cores).

Runs ``python -m sweeper search <space> --proxy`` as a user would (a simulated Ray cluster on this machine, real
megatron-core ranks, MLflow in a sqlite file of a scratch folder) for each space, one after the other, and reads
the sweep folder it wrote: the time to start (cluster, plan) and make the reference, each trial's wall time with
its ranks and phases, the confirmation, and the report and export after the last trial.

    python benchmarks/proxy_sweep.py [--spaces nemotron deepseek_v2_lite] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

LIMIT_S = 600.0


def _at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _sweep(space: str, folder: Path) -> dict:
    out = folder / "sweep"
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "sweeper", "search", space, "--proxy", "--out", str(out), "-q"],
                          cwd=folder, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ended = time.time()
    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines() if line.strip()]
    ran = [r for r in records if r.get("started_at") and r.get("ended_at")]
    sweep = json.loads((out / "sweep.json").read_text())
    first = min((_at(r["started_at"]) for r in ran), default=ended)
    last = max((_at(r["ended_at"]) for r in ran), default=ended)
    return dict(space=space, rc=proc.returncode, wall=ended - started, start_and_reference=first - started,
                after_last_trial=ended - last, records=ran, status=sweep.get("status"),
                winner=(sweep.get("best") or {}).get("layout"), tail=(proc.stdout + proc.stderr)[-1500:])


def _ranks(record: dict) -> int:
    return len(record["result"].get("rank_nodes") or [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spaces", nargs="+", default=["nemotron", "deepseek_v2_lite"])
    parser.add_argument("--keep", type=Path, help="write the sweep folders here instead of a scratch folder")
    args = parser.parse_args()
    results = []
    for space in args.spaces:
        with tempfile.TemporaryDirectory() as scratch:
            folder = args.keep / space if args.keep else Path(scratch)
            folder.mkdir(parents=True, exist_ok=True)
            result = _sweep(space, folder)
        results.append(result)
        print(f"\nsweeper search {space} --proxy: {result['wall']:.0f} s ({result['wall'] / 60:.1f} min), exit "
              f"{result['rc']}, sweep {result['status']}, winner {result['winner']}")
        print(f"  start + reference          {result['start_and_reference']:6.0f} s")
        for r in result["records"]:
            res = r["result"]
            phases = ", ".join(f"{k} {v:.0f}" for k, v in res.get("timings_s", {}).items() if v >= 1)
            seconds = _at(r["ended_at"]) - _at(r["started_at"])
            print(f"  #{r['number']}.{r['attempt']} {r['phase']:8s} {seconds:6.0f} s  {_ranks(r):2d} ranks  "
                  f"{res['status']:7s} {res.get('failure_kind') or ''} gate {res['checks'].get('equivalence_rel_err')}"
                  f"  ({phases})")
        print(f"  report and export          {result['after_last_trial']:6.0f} s")
        if result["rc"] != 0:
            print(result["tail"])
    print("\nspace               wall   limit  within")
    for result in results:
        print(f"{result['space']:18s} {result['wall']:5.0f} s {LIMIT_S:5.0f} s  {result['wall'] <= LIMIT_S}"
              f"  ({result['wall'] / LIMIT_S:.2f}x the limit)")


if __name__ == "__main__":
    main()
