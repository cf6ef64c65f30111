"""The production objective of every valid layout of a space, priced one layout at a time against all together
(issue 54: ``sweeper plan``'s table and the frontier order every valid or launchable layout by it).

Both ways in one process, interleaved, each with the objective's own memos cleared and the estimator's warm (the first
round warms them, as the plan's term table does before the table is ordered); CPU seconds, the same figures checked:

    python benchmarks/plan_objectives.py [search_spaces/deepseek_v3_1024.yaml] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sweeper.config.load import load_config  # noqa: E402
from sweeper.plan.assess import Plan  # noqa: E402
from sweeper.search.decide import objective  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("space", nargs="?", default=str(ROOT / "search_spaces/deepseek_v3_1024.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    gc.disable()  # as the plan command pauses the cycle collector
    cfg = load_config(args.space)
    entries = [e for e in Plan.build(cfg).entries() if e.valid]
    layouts, predictions = [e.layout for e in entries], [e.predicted for e in entries]
    for round_ in range(args.rounds):
        figures = []
        for way in ("one by one", "together"):
            objective._EXTRA_S.clear()  # noqa: SLF001 - each way prices afresh, not from the memo
            objective._TERMS.clear()  # noqa: SLF001
            start = time.process_time()
            if way == "together":
                figures.append(objective.predicted_objectives(cfg, layouts, predictions))
            else:
                figures.append([objective.predicted_objective(cfg, lo, p) for lo, p in zip(layouts, predictions)])
            print(f"round {round_}: {way:10s} {time.process_time() - start:.3f} s CPU for {len(layouts):,} layouts"
                  + (" (warms the estimator's memos)" if round_ == 0 and way == "one by one" else ""))
        assert figures[0] == figures[1], "the objectives priced together differ from one by one"
    return 0


if __name__ == "__main__":
    sys.exit(main())
