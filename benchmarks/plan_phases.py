"""Where `plan --json`'s CPU goes: each phase of building and writing a plan, timed in one process (issue 54).

Enumeration, the rules, the estimator (the term table of the valid layouts), the predictions and their order, the
JSON text, and the imports before them, in CPU seconds (``time.process_time``, steadier than wall on a shared host),
with the cycle collector paused as the command pauses it. Times the sweeper first on PYTHONPATH, so two checkouts
compare with interleaved runs (each with its own copy of this script: it calls ``Plan`` and ``judge``, which
checkouts before 0270634 and 131afd6 lack):

    for d in /tmp/base .; do PYTHONPATH=$d python $d/benchmarks/plan_phases.py search_spaces/deepseek_v3_1024.yaml; done

Items after the space are the command's ``--set`` overrides (``'space.precision=[fp8]'``: the 99,360-layout space).
"""

from __future__ import annotations

import gc
import sys
import time

import orjson

T = time.process_time
START = T()

from sweeper.config.load import load_config  # noqa: E402  (the imports are a phase)
from sweeper.estimate import Estimator  # noqa: E402
from sweeper.estimate.term_table import TermTable  # noqa: E402
from sweeper.plan.assess import Plan, judge  # noqa: E402
from sweeper.plan.rules import Checker  # noqa: E402
from sweeper.plan.space import enumerate_layouts  # noqa: E402


def main() -> int:
    spent = {"imports": T() - START}
    gc.disable()
    cfg = load_config(sys.argv[1], overrides=sys.argv[2:])
    t = T()
    layouts = enumerate_layouts(cfg)
    spent["enumeration"] = T() - t
    checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length, cfg.run)
    t = T()
    judged = judge(cfg, layouts, checker)  # as assess_tabled judges them
    spent["rules"] = T() - t
    t = T()
    table = TermTable.build(Estimator.for_config(cfg), [e.layout for e in judged if e.valid])
    spent["estimator"] = T() - t
    t = T()
    plan = Plan.of(judged, table, None)
    spent["predictions + order"] = T() - t
    t = T()
    text = orjson.dumps(plan.to_json()).decode()  # as cmd_plan writes it
    spent["JSON"] = T() - t
    print(f"{len(layouts)} layouts, {len(table.layouts)} valid, {len(text) / 1e6:.0f} MB of JSON; CPU s: "
          + ", ".join(f"{k} {v:.2f}" for k, v in spent.items()) + f"; total {sum(spent.values()):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
