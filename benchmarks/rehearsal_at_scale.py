"""The driver at the scale of a 1,024-GPU cluster, measured (issue 46): a rehearsed sweep (``search --rehearse``) of a
DeepSeek-V3-class space on 128 nodes x 8 GPUs (``search_spaces/deepseek_v3_1024.yaml``: ~130,000 layouts, 500
trials) run as its own process, sampled every second from outside: the driver's CPU seconds per ended trial and its
resident memory in each quarter of the ended trials, the most trials running at once, then the size
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


class Ended:
    """Trials ended so far (records of attempt 1 and up: a pruned layout's record is attempt 0), counted from the
    lines trials.jsonl gained since the last look (re-reading megabytes every second would load the driver's cores)."""

    def __init__(self, trials: Path) -> None:
        self.trials, self.offset, self.count, self.partial = trials, 0, 0, b""

    def __call__(self) -> int:
        try:
            with self.trials.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.count
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            try:
                self.count += json.loads(line).get("attempt", 0) >= 1
            except (ValueError, AttributeError, TypeError):
                continue
        return self.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--space", type=Path, default=SPACE)
    parser.add_argument("--max-trials", type=int, default=None)
    parser.add_argument("--faults", default="node_loss_per_hour=0.001,hang=0.01", help='"" for none')
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
    ended = Ended(out / "trials.jsonl")
    load_before = os.getloadavg()
    samples: list[tuple[float, int, float, float]] = []  # (wall s, trials ended, CPU s, RSS MiB)
    while proc.poll() is None:
        try:
            cpu = driver.cpu_times()
            samples.append((time.monotonic() - started, ended(), cpu.user + cpu.system,
                            driver.memory_info().rss / 2**20))
        except psutil.Error:
            break
        time.sleep(1.0)
    stderr = proc.stderr.read() if proc.stderr else ""
    if proc.returncode not in (0, 1):
        sys.exit(f"the rehearsal exited {proc.returncode}:\n{stderr[-3000:]}")
    rehearsal = json.loads((out / "rehearsal.json").read_text())
    load_after = os.getloadavg()
    trials_ended = samples[-1][1] if samples else 0
    quarter = max(1, trials_ended // 4)

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
        "machine_load_1min": {"before": round(load_before[0], 1), "after": round(load_after[0], 1)},
        "driver_wall_s": samples[-1][0] if samples else None, "trials_ended": trials_ended,
        # the driver's CPU seconds per ended trial and its median RSS in each quarter of the ended trials
        "quarters": [window(q * quarter, trials_ended if q == 3 else (q + 1) * quarter) for q in range(4)],
        "first_quarter": window(0, quarter), "last_quarter": window(trials_ended - quarter, trials_ended),
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
