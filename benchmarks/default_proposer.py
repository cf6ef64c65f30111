"""Issue 54: is the default proposer at least as good as its own prior's order? Trials to the target per seed for each
proposer, on the measured CPU landscapes and on rehearsed GPU ones whose truth carries the estimator's held-out error,
in one run.

Proposers (each sweeper's LayoutStudy, replayed as ``search_efficiency.run_study`` replays a sweep: dominance, each
trial told one of its layout's runs):
  ranked     the default (``sampler: auto`` on a space the budget does not cover; ``search.propose.ranked``): the
             step-time model's order, refitted after every measured trial, EXPLORATION of the turns (none: see
             docs/benchmarks.md) to the layout the fit is least sure of
  ranked+explore  the same with EXPLORING (every fourth turn) exploring
  prior      the estimator's own order, never refitted (the first guess alone)
  grid       the launchable layouts in the space's grid order (``sampler: grid``)
  tpe+refit  TPE with the refit model's greedy turns after two measured trials, opening with the estimator's two
             favourites on GPUs (``sampler: tpe``; the default before issue 54)
Landscapes:
  MEASURED   tests/data/landscape_{quickstart,dense,quickstart_avx512bf16}.json, every launchable layout measured 3
             times on a simulated 2 x 2 CPU cluster. The estimator's CPU efficiencies were fitted on these: they
             flatter every order that starts from the estimator.
  REHEARSED  ``proposer_comparison.rehearsed_landscape``: a GPU space's launchable layouts with rehearsal seed s's truth
             (``RehearsalHost.truth``: the estimator's terms times a level drawn at LEVEL_SIGMA 0.121 and per layout
             a factor per term and one on the step, LAYOUT_SIGMA 0.115 in all; memory at the estimator's band), 3
             runs per layout at RUN_SIGMA; replay s on truth s. Nemotron-3-Nano on 2 x 8 and the DeepSeek-V3 slice
             of proposer_comparison.
A replay stops at the first layout within max(3%, the measured noise) of the best, or after ``--limit`` launches
(counted as the limit; the table says how many replays hit it). Prints per landscape and proposer the median, p90 and
per-seed trials, and a Markdown table.

    python benchmarks/default_proposer.py [--seeds 10] [--limit 60] [--only measured|rehearsed] [--out rows.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from proposer_comparison import deepseek_slice, measured_landscapes, p90, rehearsed_landscape  # noqa: E402
from search_efficiency import Landscape, run_study  # noqa: E402

from sweeper.config.load import load_config  # noqa: E402
from sweeper.config.schema import SweepConfig  # noqa: E402
from sweeper.search.propose.ranked import EXPLORATION  # noqa: E402

# The share of exploring turns "ranked+explore" gives (every fourth turn), against the default's EXPLORATION.
EXPLORING = 0.25
PROPOSERS = {"ranked": ("ranked", EXPLORATION), "ranked+explore": ("ranked", EXPLORING), "prior": ("prior", 0.0),
             "grid": ("ordered", 0.0), "tpe+refit": ("tpe+refit", 0.0)}


def compare(name: str, cfg: SweepConfig, landscape: Callable[[int], Landscape], seeds: int, cores: int | None,
            limit: int) -> dict:
    """Each proposer's trials to the target over ``seeds`` replays; replay s on ``landscape(s)``."""
    t0 = time.perf_counter()
    counts: dict[str, list[int]] = {k: [] for k in PROPOSERS}
    capped: dict[str, int] = dict.fromkeys(PROPOSERS, 0)
    for seed in range(seeds):
        land = landscape(seed)
        target = (1 - max(0.03, land.noise)) * land.best
        for key, (mode, exploration) in PROPOSERS.items():
            outcome = run_study(cfg, land, target, seed, mode, cores, exploration=exploration, limit=limit)
            counts[key].append(outcome.launched)
            capped[key] += not outcome.reached
    n = len(land.samples)
    row = {"landscape": name, "layouts": n, "kind": land.kind, "limit": limit,
           **{k: {"median": statistics.median(v), "p90": p90(v), "per_seed": v, "capped": capped[k]}
              for k, v in counts.items()}}
    print(f"{name}: {n} launchable, {land.kind} (the last replay's); target within {100 * max(0.03, land.noise):.1f}% "
          f"({time.perf_counter() - t0:.0f} s)")
    for k, v in counts.items():
        print(f"  {k:14s} median {statistics.median(v):5.1f}  p90 {p90(v):5.1f}  at the limit {capped[k]:2d}  "
              f"per seed {v}")
    pairs = list(zip(counts["ranked"], counts["prior"], strict=True))
    row["ranked_vs_prior"] = [sum(a < b for a, b in pairs), sum(a == b for a, b in pairs), sum(a > b for a, b in pairs)]
    print(f"  ranked vs prior, seeds fewer / as many / more trials: {'/'.join(map(str, row['ranked_vs_prior']))}",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--limit", type=int, default=60, help="launches per replay at most")
    parser.add_argument("--only", choices=["measured", "rehearsed"], help="one kind of landscape")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    rows = []
    if args.only != "rehearsed":
        for name, cfg, land, cores in measured_landscapes():
            rows.append(compare(name, cfg, lambda _, land=land: land, args.seeds, cores, args.limit))
    if args.only != "measured":
        for label, cfg in (("nemotron", load_config(ROOT / "search_spaces/nemotron.yaml")),
                           ("deepseek_v3 slice", deepseek_slice())):
            rows.append(compare(f"{label} rehearsed", cfg, functools.partial(rehearsed_landscape, cfg), args.seeds,
                                None, args.limit))
    print("\n| landscape | layouts | " + " | ".join(f"{k} median / p90" for k in PROPOSERS)
          + " | ranked vs prior: seeds fewer / same / more |\n|---|---|" + "---|" * (len(PROPOSERS) + 1))
    for r in rows:
        cells = [f"{r[k]['median']:g} / {r[k]['p90']:g}" + (f" ({r[k]['capped']} at {r['limit']})" if r[k]['capped']
                                                             else "") for k in PROPOSERS]
        print(f"| {r['landscape']} | {r['layouts']} | " + " | ".join(cells)
              + f" | {' / '.join(map(str, r['ranked_vs_prior']))} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
