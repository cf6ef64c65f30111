"""How many launched trials each strategy needs to find a layout within 3% of the best.

Landscape: STAND-IN. No recorded multi-node sweep exists yet, so the estimator's predicted tokens/s plays the
measured throughput of every layout (layouts the rules reject or the estimator predicts over the memory budget
are refused before launch, exactly as in a sweep, and do not count as launched). Strategies:
  tpe     - sweeper's study: multivariate TPE with constraints and constant liar (define-by-run over the axes)
  random  - uniformly random launchable layouts, without repetition
  grid    - launchable layouts in enumeration order
Prints, per strategy, the median over seeds of launched trials to reach 97% of the best and that as a share of
the launchable layouts, and the TPE / random ratio. Goal (issue 5): best within 3% after <= 15% of the layouts.

    python benchmarks/search_efficiency.py [search_spaces/nemotron.yaml] [--seeds 5]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import optuna

from sweeper.config import SweepConfig, load_config
from sweeper.layout import Layout
from sweeper.plan import assess
from sweeper.space import enumerate_layouts
from sweeper.study import LayoutStudy


def landscape(cfg: SweepConfig) -> dict[Layout, float]:
    out = {}
    for layout in enumerate_layouts(cfg):
        entry = assess(cfg, layout)
        if entry.launchable and entry.predicted and entry.predicted.tokens_per_s:
            out[layout] = entry.predicted.tokens_per_s
    return out


def trials_to_target(order: list[Layout], values: dict[Layout, float], target: float) -> int:
    for i, layout in enumerate(order, 1):
        if values[layout] >= target:
            return i
    return len(order)


def run_tpe(cfg: SweepConfig, values: dict[Layout, float], target: float, seed: int, limit: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        study = LayoutStudy(cfg, Path(tmp) / "journal.log", exhaustive=False, seed=seed)
        seen: set[Layout] = set()
        launched = asks = 0
        while launched < limit and asks < 50 * limit:
            proposal = study.ask()
            asks += 1
            layout = proposal.layout
            if layout in seen:
                study.skip(proposal.trial)
                continue
            seen.add(layout)
            if layout not in values:  # refused before launch: infeasible, not launched
                study.tell(proposal.trial, 0.0, infeasible=True)
                continue
            launched += 1
            study.tell(proposal.trial, values[layout], infeasible=False)
            if values[layout] >= target:
                return launched
        return launched


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("space", nargs="?", default="search_spaces/nemotron.yaml")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").setLevel(logging.WARNING)

    cfg = load_config(args.space)
    t0 = time.perf_counter()
    values = landscape(cfg)
    best = max(values.values())
    target = 0.97 * best
    n = len(values)
    print(f"space {args.space}: {n} launchable layouts (stand-in landscape: estimator predictions), "
          f"best {best:,.0f} tokens/s, target {target:,.0f} ({time.perf_counter() - t0:.1f} s to build)")

    grid = trials_to_target(list(values), values, target)
    randoms, tpes = [], []
    for seed in range(args.seeds):
        order = list(values)
        random.Random(seed).shuffle(order)
        randoms.append(trials_to_target(order, values, target))
        tpes.append(run_tpe(cfg, values, target, seed, limit=n))
    rows = [("tpe", statistics.median(tpes)), ("random", statistics.median(randoms)), ("grid", grid)]
    for name, count in rows:
        print(f"{name:7s} median trials to 97% of best: {count:6.1f}  ({100 * count / n:5.1f}% of launchable)")
    print(f"ratio tpe/random: {statistics.median(tpes) / statistics.median(randoms):.2f}; "
          f"tpe per seed: {tpes}; random per seed: {randoms}")
    print(f"goal <= 15% of launchable: {'met' if statistics.median(tpes) <= 0.15 * n else 'NOT met'}")


if __name__ == "__main__":
    main()
