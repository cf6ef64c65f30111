"""The driver's own cost per event on a space of over 100,000 layouts (issues 43, 46): what a measured trial costs
the frontier before and after its incremental re-assessment, in one run.

The space: benchmarks/spaces/nemotron_wide.yaml widened to 128 nodes x 8 GPUs and trials of 8 to 1,024 GPUs. The
frontier (sweeper/search/propose/frontier.py) is built over it as a sweep builds it, with a stand-in cluster handle
(no Ray:
every layout is supported) and a fresh sweep folder. Then measured trials arrive as a GPU sweep records them: a
device peak under the limit (memory evidence) or an out-of-memory failure, each one an event that changes verdicts
but not the calibration. "before" re-assesses the whole space on every such event (rules and estimator for every
layout, as the frontier did before issue 43); "after" keeps the predictions until the calibration changes. Then
the events that do change the calibration (on GPUs, nearly every passed trial: its step time and device peak refit
both): "fresh" assesses the space again with a new estimator (rules and estimator for every layout, as before issue
46), "recalibrated" keeps the rules' verdicts and re-predicts the valid layouts with the estimator recalibrated (its
memos kept; issue 46), "term table" re-predicts them in one vectorised pass over their term table (issue 54, what the
frontier does now); the re-prediction alone and the whole event (re-prediction, verdicts) are timed, and
the table's predictions checked equal to the recalibrated estimator's. sweep.json is no part of an event (the sweep
writes it at most every 30 s, issue 54): writing it with the per-layout lists after a calibration change is timed
on its own. One proposal (the next launchable layout not
yet taken) is timed too. Prints CPU seconds and the ratios. Since the frontier keeps the rules' verdicts apart from
its predictions (branch driver2, issue 54), "before" and "fresh" build a new estimator and term table for every valid
layout and keep the rules' verdicts: less than they name.

    python benchmarks/driver_events.py [--events 5] [--space search_spaces/deepseek_v3_1024.yaml] [--no-fresh]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sweeper.config.load import load_config  # noqa: E402
from sweeper.estimate import Calibration  # noqa: E402
from sweeper.estimate.calibrator import Calibrator  # noqa: E402
from sweeper.plan.assess import reassess, repredict  # noqa: E402
from sweeper.record.schema import TrialMetrics, TrialResult  # noqa: E402
from sweeper.record.sweepdir import SweepDir  # noqa: E402
from sweeper.search.propose.frontier import Frontier  # noqa: E402

WIDE = {"cluster": {"nodes": 128}, "space": {"gpus": [8, 16, 32, 64, 128, 256, 512, 1024],
                                              "ep": [1, 2, 4, 8, 16, 32, 64], "pp": [1, 2, 4, 8],
                                              "mbs": [1, 2, 4]}}


class StandInHandle:
    """Stand-in for the trial host (no Ray): every layout is supported."""

    def unsupported(self, model: object, layout: object) -> None:
        return None


def config(yaml: Path | None) -> object:
    if yaml is not None:  # a space as its YAML says (the DeepSeek-V3 one is 1,024 GPUs already)
        return load_config(yaml)
    cfg = load_config(ROOT / "benchmarks" / "spaces" / "nemotron_wide.yaml")
    cluster = cfg.cluster.model_copy(update=WIDE["cluster"])
    space = cfg.space.model_copy(update=WIDE["space"])
    training = cfg.training.model_copy(update={"global_batch_size": 4096})
    return cfg.model_copy(update={"cluster": cluster, "space": space, "training": training})


def cpu() -> float:
    return time.process_time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=5)
    parser.add_argument("--space", type=Path, help="a space YAML instead of the widened Nemotron one")
    parser.add_argument("--no-fresh", action="store_true", help="leave out the fresh assessment (slow on 100k+)")
    args = parser.parse_args()
    cfg = config(args.space)
    with tempfile.TemporaryDirectory() as tmp:
        started = cpu()
        frontier = Frontier(cfg, StandInHandle(), Calibrator(cfg, Path(tmp)), [], lambda layout: False)
        build_s = cpu() - started
        layouts = len(frontier._layouts)  # noqa: SLF001 - the benchmark reads the frontier's space
        launchable = list(frontier.launchable)
        print(f"space: {layouts:,} layouts, {len(launchable):,} launchable; frontier built in {build_s:.1f} s CPU")
        before, after = [], []
        for i in range(args.events):
            entry = launchable[(i * 7919) % len(launchable)]
            assert entry.predicted is not None
            peak = entry.predicted.memory_gib * (0.9 if i % 2 else 1.5)  # a fit below the limit, or an OOM
            oom = peak > cfg.memory_limit_gib
            result = TrialResult(status="failed" if oom else "passed", failure_kind="oom" if oom else None,
                                 metrics=TrialMetrics(peak_memory_gib=peak, tokens_per_s=1.0, step_time_s=1.0),
                                 memory_kind="device")
            frontier._plan_calibration = frontier  # noqa: SLF001 - "before": the plan made again on every event,
            frontier._estimator = None  # noqa: SLF001 - from scratch
            started = cpu()
            frontier.learn(100 + i, entry.layout, result, calibration_changed=False)
            before.append(cpu() - started)
            started = cpu()
            frontier.learn(200 + i, entry.layout, result, calibration_changed=False)  # "after": the plan kept
            after.append(cpu() - started)
        fresh, recalibrated, tabled, event, saved = [], [], [], [], []
        sweep_dir = SweepDir(Path(tmp))
        for i in range(args.events):
            entry = launchable[(i * 7919) % len(launchable)]
            result = TrialResult(status="passed", metrics=TrialMetrics(peak_memory_gib=1.0, tokens_per_s=1.0,
                                                                       step_time_s=1.0), memory_kind="device")
            calibration = Calibration(activation_factor=1.0 + 0.01 * i, state_factor=0.98,
                                      step_time_factor=1.1 + 0.01 * i)
            plan = frontier.assessed
            estimator = frontier._estimator  # noqa: SLF001 - the issue-46 path: the estimator recalibrated
            assert estimator is not None
            started = cpu()
            old = reassess(plan, estimator.recalibrated(calibration))
            recalibrated.append(cpu() - started)
            table = frontier._table  # noqa: SLF001 - the issue-54 path: the term table
            assert table is not None
            started = cpu()
            new = repredict(plan, table, calibration)
            tabled.append(cpu() - started)
            assert [e.predicted for e in old] == [e.predicted for e in new], "the table must equal the estimator"
            del old, new
            frontier.calibrator.current = calibration
            started = cpu()
            frontier.learn(300 + i, entry.layout, result, calibration_changed=True)
            event.append(cpu() - started)
            started = cpu()  # what the sweep writes at most every SAVE_EVERY_S (search/run/state.py: save_progress)
            meta = sweep_dir.read_meta()
            for key, entries in frontier.verdict_lists().items():
                setattr(meta, key, entries)
            sweep_dir.write_meta(meta)
            saved.append(cpu() - started)
            if not args.no_fresh:
                frontier.calibrator.current = Calibration(activation_factor=1.0 + 0.01 * i, state_factor=0.97)
                frontier._estimator = None  # noqa: SLF001 - "fresh": a new estimator, every layout's rules
                started = cpu()
                frontier.learn(400 + i, entry.layout, result, calibration_changed=True)
                fresh.append(cpu() - started)
        invalid = [p for p in frontier.assessed if not p.valid]
        r, t, e = statistics.median(recalibrated), statistics.median(tabled), statistics.median(event)
        print(f"per calibration change (median of {args.events}), re-predicting the {len(plan) - len(invalid):,} valid "
              f"layouts: recalibrated estimator {r:.2f} s CPU, term table {t:.2f} s CPU: {r / t:.1f}x less "
              f"(equal predictions); the whole event with the table {e:.2f} s CPU")
        size = (Path(tmp) / "sweep.json").stat().st_size / 1e6
        print(f"  sweep.json with the lists after a calibration change (the sweep writes it at most every 30 s, not "
              f"per event): {statistics.median(saved):.2f} s CPU, {size:.1f} MB")
        if fresh:
            f = statistics.median(fresh)
            print(f"  fresh assessment of the space (rules, a new estimator and table) {f:.2f} s CPU: {f / e:.1f}x "
                  "the event")
        started = cpu()
        proposal = next((e.layout for e in frontier.launchable if not frontier.taken(e.layout)), None)
        propose_s = cpu() - started
        b, a = statistics.median(before), statistics.median(after)
        print(f"per measured-trial event (median of {args.events}): before {b:.2f} s CPU, after {a:.2f} s CPU: "
              f"{b / a:.1f}x less")
        print(f"one proposal: {propose_s * 1e3:.2f} ms CPU ({proposal.short() if proposal else 'none left'})")


if __name__ == "__main__":
    main()
