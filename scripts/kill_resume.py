"""Kill the sweep's driver at random moments and resume it each time: does it lose, duplicate or re-run anything?

A real sweep (tiny GPT, real megatron-core on a simulated 2 x 2 Ray cluster, a local MLflow store) gets SIGKILL N
times, each at a moment drawn (seeded) inside a phase, in this order: while the equivalence reference is made, while
a trial runs, right after a trial ended (between trials), while a confirmation runs, and while the report and the
exports are written; after each kill ``sweeper search --resume`` goes on. The phase a kill hit is read from the
driver's log at that moment (the last thing it said). After the sweep finishes:
  - every launched attempt is in trials.jsonl exactly once (trial number, attempt, phase), and no layout that had
    ended (passed or failed for its own reasons) ran again;
  - the Optuna journal agrees: each explored layout told once with a value, none left RUNNING;
  - MLflow agrees: exactly one finished child run per recorded attempt, the rest (attempts a kill interrupted)
    KILLED, none RUNNING;
  - no dead driver's simulated cluster left a process, placement group or warm rank behind (the cluster records
    under /tmp/sweeper-clusters name every process a driver started);
  - the winner in best_layout.yaml is the one sweeper's selection picks from the recorded results, as an
    uninterrupted sweep with these results would.

    python scripts/kill_resume.py [--kills 10] [--seed 0] [--keep DIR]

Prints one line per kill (phase hit, seconds into the run) and the checks; exit 1 when a check fails.
tests/search/test_faults.py runs it with 3 kills in CI and with 10 under ``-m slow``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sweeper.config.load import load_config  # noqa: E402
from sweeper.record.sweepdir import SweepDir  # noqa: E402
from sweeper.search.decide.candidates import candidates, choose  # noqa: E402
from sweeper.search.decide.verdicts import NOT_THE_LAYOUTS  # noqa: E402

RECORDS = Path("/tmp/sweeper-clusters")  # where each driver lists the processes of its simulated cluster
LAUNCH = re.compile(r"^launch #(\d+\.\d+) (explore|confirm) ")
RESULT = re.compile(r"^(passed|failed) #(\d+\.\d+) ")
# How long after its moment begins a kill waits (uniformly drawn up to this, seconds): inside the reference run or a
# trial's steps, at once between trials, within the second the report and the exports take.
JITTER = {"reference": 1.0, "exploring": 1.0, "between trials": 0.0, "confirmation": 1.0, "report": 0.3}


def space(folder: Path) -> Path:
    doc = {
        "name": "kill-resume",
        "model": "tiny-gpt",
        "cluster": {"nodes": 2, "gpus_per_node": 2, "gpu_memory_gib": 4, "compute_capability": "9.0"},
        "training": {"seq_length": 32, "global_batch_size": 4, "steps": 3, "warmup_steps": 1, "trial_timeout_s": 180},
        "space": {"gpus": [2, 4], "tp": [1, 2], "pp": [1, 2], "mbs": [1, 2], "precision": ["fp32"]},
        "search": {"max_trials": 10, "confirm_top": 1, "seed": 0},
        "tracking": {"mlflow_tracking_uri": f"sqlite:///{folder / 'mlflow.db'}"},
    }
    path = folder / "space.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def plan(kills: int) -> list[str]:
    """The phase each kill aims at: the reference first, then trials and the gaps between them, and the last two
    at the confirmation and the report."""
    middle = ["exploring", "between trials"] * kills
    return (["reference"] + middle[: max(0, kills - 3)] + ["confirmation", "report"])[:kills]


def start(folder: Path, space_file: Path, resume: bool, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "sweeper", "search", str(space_file), "--out", "sweep"]
    cmd += ["--resume"] if resume else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.Popen(cmd, cwd=folder, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def lines(log: Path) -> list[str]:
    return [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]


def phase_of(text: list[str], folder: Path) -> str:
    """The phase a driver is in, from what it wrote: before its reference line (and the reference run started), a
    confirmation's result written (the report and exports follow), a confirmation or a trial running, or none."""
    if not any(line.startswith("equivalence") for line in text):
        return "reference" if any((folder / "sweep" / "reference-run").glob("**/rank_*.log")) else "starting"
    running: dict[str, str] = {}
    confirmed = False
    for line in text:
        if (m := LAUNCH.match(line)) is not None:
            running[m.group(1)] = m.group(2)
        elif (m := RESULT.match(line)) is not None:
            confirmed |= running.pop(m.group(2), None) == "confirm"
    if confirmed and not running:
        return "report"
    if "confirm" in running.values():
        return "confirmation"
    if RESULT.match(text[-1]):  # a trial's result just recorded (others may still run beside it)
        return "between trials"
    return "exploring" if running else "between trials"


def kill_at(proc: subprocess.Popen[bytes], log: Path, folder: Path, target: str, rng: random.Random,
            t0: float) -> str | None:
    """Wait until the driver is in the target phase (for "between trials": the moment a trial's result is written),
    wait a drawn moment more, SIGKILL it; the phase it was in then, or None when the sweep ended first."""
    results = 0
    while proc.poll() is None:
        text = lines(log)
        now = phase_of(text, folder)
        new_result = sum(1 for line in text if RESULT.match(line)) > results
        results = sum(1 for line in text if RESULT.match(line))
        if now == target and (target != "between trials" or new_result):  # the moment a result is written
            time.sleep(rng.uniform(0, JITTER[target]))
            if proc.poll() is not None:
                return None
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            hit = phase_of(lines(log), folder)
            print(f"  kill aimed at {target:>14s}: hit {hit:>14s} at {time.monotonic() - t0:6.1f} s", flush=True)
            return hit
        time.sleep(0.05)
    return None


def leaked(pids: list[int]) -> list[int]:
    """Processes of dead drivers' simulated clusters still alive."""
    alive = []
    for path in RECORDS.glob("cluster-*.json") if RECORDS.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("driver_pid") in pids:
            alive += [pid for pid, _ in record.get("processes", []) if psutil.pid_exists(pid)]
    return alive


def check(folder: Path, space_file: Path) -> list[str]:
    """The checks of the module's docstring; the failures, one line each."""
    import optuna
    from mlflow.tracking import MlflowClient
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    problems = []
    sweep = SweepDir(folder / "sweep")
    records = sweep.read_trials()
    launched = [r for r in records if r.attempt >= 1]
    keys = Counter((r.number, r.attempt, r.phase) for r in launched)
    problems += [f"attempt {k} recorded {n} times" for k, n in keys.items() if n > 1]
    ended = Counter(json.dumps(r.layout, sort_keys=True) for r in launched
                    if r.phase == "explore" and r.result.failure_kind not in NOT_THE_LAYOUTS)
    problems += [f"layout {k} ended {n} times" for k, n in ended.items() if n > 1]

    storage = JournalStorage(JournalFileBackend(str(sweep.journal)))
    trials = [t for name in optuna.get_all_study_names(storage)
              for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)]
    if any(t.state == TrialState.RUNNING for t in trials):
        problems.append("Optuna trials left RUNNING")
    told = Counter(int(t.user_attrs["sweeper_number"]) for t in trials
                   if t.state == TrialState.COMPLETE and "sweeper_number" in t.user_attrs)
    explored = {r.number for r in launched if r.phase == "explore" and r.result.failure_kind not in NOT_THE_LAYOUTS}
    problems += [f"Optuna told trial {n} {c} times" for n, c in told.items() if c > 1]
    if set(told) != explored:
        problems.append(f"Optuna told {sorted(told)}, trials.jsonl ended {sorted(explored)}")

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    runs = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
            if r.data.tags.get("sweeper.kind") == "trial"]
    finished = Counter((int(r.data.tags["sweeper.trial_number"]), int(r.data.tags["sweeper.attempt"]),
                        r.data.tags["sweeper.phase"]) for r in runs if r.info.status in ("FINISHED", "FAILED"))
    if finished != keys:
        problems.append(f"MLflow finished runs {dict(finished)} != trials.jsonl attempts {dict(keys)}")
    if any(r.info.status == "RUNNING" for r in runs):
        problems.append("MLflow runs left RUNNING")

    cfg = load_config(space_file)
    winner = choose(candidates(records, cfg), cfg, confirmed_only=cfg.search.confirm_top > 0)
    best = yaml.safe_load(sweep.best.read_text()) if sweep.best.is_file() else None
    if winner is None or best is None or best.get("trial") != winner.number:
        problems.append(f"best_layout.yaml names {best and best.get('trial')}, the records' winner is "
                        f"{winner and winner.number}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        space_file = space(folder)
        t0 = time.monotonic()
        hits: list[str] = []
        drivers: list[int] = []
        resume = False
        for i, target in enumerate(plan(args.kills)):
            proc = start(folder, space_file, resume, folder / f"driver-{i}.log")
            drivers.append(proc.pid)
            hit = kill_at(proc, folder / f"driver-{i}.log", folder, target, rng, t0)
            resume = True
            if hit is None:  # the sweep ended before this kill
                print(f"  the sweep finished before the kill aimed at {target} (exit {proc.returncode})")
                break
            hits.append(hit)
        else:
            proc = start(folder, space_file, True, folder / "driver-final.log")
            drivers.append(proc.pid)
            proc.wait()
        final = folder / ("driver-final.log" if len(hits) == args.kills else f"driver-{len(hits)}.log")
        if proc.returncode != 0:
            print(f"the last run exited {proc.returncode}:\n" + "\n".join(lines(final)[-30:]))
            return 1
        time.sleep(2)  # the last driver's cluster shuts down as it exits
        problems = check(folder, space_file)
        gone = leaked(drivers)
        if gone:
            problems.append(f"processes of dead drivers' clusters still alive: {gone}")
        phases = Counter(hits)
        print(f"{len(hits)} kills ({', '.join(f'{p} {n}' for p, n in phases.items())}), "
              f"{len(drivers)} driver runs, {time.monotonic() - t0:.0f} s; "
              f"{len(SweepDir(folder / 'sweep').read_trials())} records")
        for line in problems:
            print(f"FAILED: {line}")
        if not problems:
            print("exactly once: every attempt recorded once, in Optuna and MLflow alike; nothing finished re-run; "
                  "no process left behind; the winner is the records' winner")
        return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
