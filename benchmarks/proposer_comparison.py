"""How the refit model's turns should choose (issue 46): greedy (its best predicted untried layout) against expected
improvement over the best measured layout given what the fit leaves unknown (``search.propose.refit``), TPE alone as the
reference, on measured and rehearsed landscapes.

Landscapes:
  MEASURED   the three CPU landscapes of benchmarks/search_efficiency.py (every launchable layout measured 3 times on
             a simulated 2 x 2 cluster), replayed as there: each trial told one of its layout's measured repeats.
  REHEARSED  a GPU space's launchable layouts with the rehearsal's truth (``trial.rehearsal.RehearsalHost.truth``:
             the estimator's step-time terms, each times a drawn error, TERM_SIGMA per term per layout, and the whole
             times a drawn LEVEL_SIGMA level; the memory's error drawn at the estimator's band, out of memory where
             the drawn peak exceeds the GPU), one truth per rehearsal seed; each layout runs REPEATS times with the
             rehearsal's RUN_SIGMA noise, and a trial is told one of those. The sweep opens with the estimator's two
             favourites, as on GPUs. Replay s of a rehearsed landscape draws truth s: the comparison is over the
             estimator's errors as well as the samplers' seeds.
Layouts are judged by the sweep's objective (the production run's throughput, ``search.objective``). Target: the
best layout's value less max(3%, the measured noise) (rehearsed: the truth's best less 3%). Prints, per
landscape and strategy, the median and p90 over seeds of trials launched until one reached the target, and the
ei / greedy ratio of the medians.

    python benchmarks/proposer_comparison.py [--seeds 20] [--only rehearsed] [--landscape deepseek]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from search_efficiency import Landscape, measured_landscape, run_study  # noqa: E402

from sweeper.config.load import load_config  # noqa: E402
from sweeper.config.schema import SweepConfig  # noqa: E402
from sweeper.plan.assess import assess_all  # noqa: E402
from sweeper.plan.space import enumerate_layouts  # noqa: E402
from sweeper.record.schema import TrialMetrics, TrialResult  # noqa: E402
from sweeper.search.decide.objective import objective_value  # noqa: E402
from sweeper.trial.rehearsal import RUN_SIGMA, Faults, RehearsalHost  # noqa: E402

MEASURED = ["tests/data/landscape_quickstart.json", "tests/data/landscape_dense.json",
            "tests/data/landscape_quickstart_avx512bf16.json"]
# Runs per layout of a rehearsed landscape: as many repeats as the measured ones have.
REPEATS = 3
# DeepSeek-V3 on 128 x 8 H100 (search_spaces/deepseek_v3_1024.yaml), sliced to trials of 256 and 512 GPUs in FP8:
# 1,254 launchable layouts at issue 54's last stop (505 at issue 46's), a fraction of the space's, so that its 60
# replays take minutes (14 on the 2-core machine, most of it the replays that never reach the target).
DEEPSEEK_SLICE = {"gpus": [256, 512], "precision": ["fp8"]}


def rehearsed_landscape(cfg: SweepConfig, seed: int) -> Landscape:
    """The launchable layouts of ``cfg`` with rehearsal seed ``seed``'s truth (module docstring)."""
    host = RehearsalHost(cfg, Faults(), seed)
    rng = random.Random(f"{seed}:repeats")
    samples: dict = {}
    trials: dict = {}
    for entry in assess_all(cfg, enumerate_layouts(cfg)):
        if not entry.launchable:
            continue
        truth = host.truth(entry.layout)
        if truth is None:
            continue
        if truth.peak_memory_gib > cfg.cluster.gpu_memory_gib:
            samples[entry.layout] = []
            trials[entry.layout] = [TrialResult(status="failed", failure_kind="oom",
                                                metrics=TrialMetrics(peak_memory_gib=truth.peak_memory_gib))]
            continue
        runs = []
        for _ in range(REPEATS):
            step = truth.step_time_s * math.exp(rng.gauss(0.0, RUN_SIGMA))
            runs.append(TrialResult(status="passed", metrics=TrialMetrics(
                tokens_per_s=truth.tokens_per_s * truth.step_time_s / step, step_time_s=step,
                peak_memory_gib=truth.peak_memory_gib)))
        # Over the memory limit but not the GPU: it runs, and is not stable (search.decide.candidates.is_stable).
        noiseless = TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=truth.tokens_per_s,
                                                                      step_time_s=truth.step_time_s))
        stable = truth.peak_memory_gib <= cfg.memory_limit_gib
        samples[entry.layout] = [objective_value(noiseless, cfg, entry.layout)] if stable else []
        trials[entry.layout] = runs
    return Landscape(samples, f"rehearsed truth, seed {seed}", trials, RUN_SIGMA)


def deepseek_slice() -> SweepConfig:
    cfg = load_config(ROOT / "search_spaces/deepseek_v3_1024.yaml")
    return cfg.model_copy(update={"space": cfg.space.model_copy(update=DEEPSEEK_SLICE)})


def measured_landscapes() -> Iterator[tuple[str, SweepConfig, Landscape, int | None]]:
    """Each measured landscape (``MEASURED``): its name, the space's config, the landscape and the machine's cores."""
    for path in MEASURED:
        table = json.loads((ROOT / path).read_text())
        cfg = load_config(ROOT / table["space"])
        yield Path(path).stem, cfg, measured_landscape(table, cfg), table["machine"]["cores"]


def p90(values: list[int]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def compare(name: str, cfg: SweepConfig, landscape: Callable[[int], Landscape], seeds: int,
            cores: int | None) -> dict:
    """Each strategy's trials to the target over ``seeds`` replays; replay s on ``landscape(s)``."""
    t0 = time.perf_counter()
    counts: dict[str, list[int]] = {"tpe": [], "greedy": [], "ei": []}
    for seed in range(seeds):
        land = landscape(seed)
        target = (1 - max(0.03, land.noise)) * land.best
        counts["tpe"].append(run_study(cfg, land, target, seed, "tpe").launched)
        for acquisition in ("greedy", "ei"):
            counts[acquisition].append(run_study(cfg, land, target, seed, "tpe+refit", cores, acquisition).launched)
        print(f"  {name} replay {seed}: " + ", ".join(f"{k} {v[-1]}" for k, v in counts.items())
              + f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    n = len(land.samples)
    failed = sum(1 for v in land.samples.values() if not v)
    row = {"landscape": name, "layouts": n, "failed": failed, "kind": land.kind,
           **{k: {"median": statistics.median(v), "p90": p90(v), "per_seed": v} for k, v in counts.items()}}
    print(f"{name}: {n} launchable ({failed} failed or unstable; the last replay's), {land.kind}; target within "
          f"{100 * max(0.03, land.noise):.1f}% ({time.perf_counter() - t0:.0f} s)")
    for k, v in counts.items():
        print(f"  {k:6s} median {statistics.median(v):5.1f}  p90 {p90(v):5.1f}  per seed {v}")
    pairs = list(zip(counts["ei"], counts["greedy"], strict=True))
    row["ei_vs_greedy"] = [sum(e < g for e, g in pairs), sum(e == g for e, g in pairs), sum(e > g for e, g in pairs)]
    print(f"  ei / greedy: median {row['ei']['median'] / row['greedy']['median']:.2f}, "
          f"p90 {row['ei']['p90'] / row['greedy']['p90']:.2f}; seeds where ei took fewer / as many / more trials: "
          f"{'/'.join(map(str, row['ei_vs_greedy']))}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--only", choices=["measured", "rehearsed"], help="one kind of landscape")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    parser.add_argument("--landscape", help="only the landscapes whose name contains this (e.g. deepseek)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").setLevel(logging.WARNING)

    rows = []
    if args.only != "rehearsed":
        for name, cfg, land, cores in measured_landscapes():
            if args.landscape and args.landscape not in name:
                continue
            rows.append(compare(name, cfg, lambda _, land=land: land, args.seeds, cores))
    if args.only != "measured":
        for label, cfg in (("nemotron", load_config(ROOT / "search_spaces/nemotron.yaml")),
                           ("deepseek_v3 slice", deepseek_slice())):
            if args.landscape and args.landscape not in label:
                continue
            rows.append(compare(f"{label} rehearsed", cfg, functools.partial(rehearsed_landscape, cfg), args.seeds,
                                None))
    print("\n| landscape | layouts | TPE median / p90 | greedy refit median / p90 | EI refit median / p90 | "
          "EI / greedy (median) | seeds EI fewer / same / more |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['landscape']} | {r['layouts']} | {r['tpe']['median']:g} / {r['tpe']['p90']:g} | "
              f"{r['greedy']['median']:g} / {r['greedy']['p90']:g} | {r['ei']['median']:g} / {r['ei']['p90']:g} | "
              f"{r['ei']['median'] / r['greedy']['median']:.2f} | {' / '.join(map(str, r['ei_vs_greedy']))} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
