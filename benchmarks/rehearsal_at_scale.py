"""The driver at the scale of a 1,024-GPU cluster, measured (issue 46): a rehearsed sweep (``search --rehearse``) of a
DeepSeek-V3-class space on 128 nodes x 8 GPUs (``search_spaces/deepseek_v3_1024.yaml``: ~130,000 layouts, 500
trials) run as its own process, sampled every second from outside: the driver's CPU seconds per ended trial and its
resident memory, each in the first and the last quarter of the trials, the most trials running at once, then the size
of ``sweep.json`` / ``trials.jsonl`` and the time ``sweeper report`` takes to render the report.

    python benchmarks/rehearsal_at_scale.py                 # ~20-40 min on 2 cores; writes rehearsal_at_scale.json
    python benchmarks/rehearsal_at_scale.py --max-trials 60 # a shorter look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SPACE = ROOT / "search_spaces" / "deepseek_v3_1024.yaml"


def _ended(trials: Path) -> int:
    try:
        return sum(1 for line in trials.read_text().splitlines() if '"attempt": 0' not in line)
    except OSError:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--space", type=Path, default=SPACE)
    parser.add_argument("--max-trials", type=int, default=None)
    parser.add_argument("--faults", default="node_loss_per_hour=0.001,hang=0.01")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "rehearsal_at_scale.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sweeper-rehearsal-"))
    out = work / "sweep"
    cmd = [sys.executable, "-m", "sweeper", "search", str(args.space.resolve()), "--rehearse", "--rehearse-faults",
           args.faults, "--out", str(out), "-q"] + (["--max-trials", str(args.max_trials)] if args.max_trials else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SWEEPER_CACHE": str(work / "cache")}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    driver = psutil.Process(proc.pid)
    samples: list[tuple[float, int, float, float]] = []  # (wall s, trials ended, CPU s, RSS MiB)
    while proc.poll() is None:
        try:
            cpu = driver.cpu_times()
            samples.append((time.monotonic() - started, _ended(out / "trials.jsonl"), cpu.user + cpu.system,
                            driver.memory_info().rss / 2**20))
        except psutil.Error:
            break
        time.sleep(1.0)
    stderr = proc.stderr.read() if proc.stderr else ""
    if proc.returncode not in (0, 1):
        sys.exit(f"the rehearsal exited {proc.returncode}:\n{stderr[-3000:]}")
    rehearsal = json.loads((out / "rehearsal.json").read_text())
    ended = samples[-1][1] if samples else 0
    quarter = max(1, ended // 4)

    def window(lo: int, hi: int) -> dict[str, float]:
        inside = [s for s in samples if lo <= s[1] <= hi]
        if len(inside) < 2 or inside[-1][1] == inside[0][1]:
            return {}
        return {"cpu_s_per_trial": (inside[-1][2] - inside[0][2]) / (inside[-1][1] - inside[0][1]),
                "rss_mib_median": statistics.median(s[3] for s in inside)}

    started = time.monotonic()
    report = subprocess.run([sys.executable, "-m", "sweeper", "report", str(out)], cwd=work, env=env,
                            capture_output=True, text=True)
    render_s = time.monotonic() - started
    figures = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "space": str(args.space.relative_to(ROOT)) if args.space.is_relative_to(ROOT) else str(args.space.resolve()),
        "machine": {"cores": os.cpu_count(), "python": sys.version.split()[0]},
        "driver_wall_s": samples[-1][0] if samples else None, "trials_ended": ended,
        "first_quarter": window(0, quarter), "last_quarter": window(ended - quarter, ended),
        "driver_cpu_s_total": samples[-1][2] if samples else None,
        "sweep_json_bytes": (out / "sweep.json").stat().st_size,
        "trials_jsonl_bytes": (out / "trials.jsonl").stat().st_size,
        "report_render_s": round(render_s, 2), "report_ok": report.returncode == 0,
        "rehearsal": rehearsal,
    }
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps({k: v for k, v in figures.items() if k != "rehearsal"}, indent=1))
    print(f"wrote {args.out}; the sweep folder is {out}")


if __name__ == "__main__":
    main()
