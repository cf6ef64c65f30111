"""Measure how far known-correct layouts' loss and gradient-norm trajectories stray from the reference layout's
over a confirmation's steps, per precision, on the CPU backend (issue 53).

For each model this makes a one-rank FP32 reference (the sweep's, ``make_reference``), then runs the reference
layout itself (one rank) and every axis the CPU backend runs alone at two ranks (TP2+SP, PP2, DP2, EP2 for MoE)
and one four-rank layout (TP2 DP2, MoE: EP2 DP2), each loading the reference and training ``--steps`` steps on the
same global batch (the data is drawn by global sequence index, so every layout sees the same batches). The table
holds, per layout and precision, each step's relative difference from the one-rank run of the same precision
(max of loss and gradient norm) and its maximum: the band ``search/decide/verdicts.TRAJECTORY_BAND`` is set from
the worst layout that passed every check of its run (a failed one is listed with its failure, not counted).
Ranks run without Ray, through the test helper ``tests/backends/megatron_ranks.py``, which checks no layout rule:
so each layout is held to sweeper's rules here first, and one they refuse is listed under ``refused`` with the
rule's reason instead of run (the MoE's TP2+SP at ETP 1 below megatron-core 0.19, whose experts' gradients
Megatron reduces over the wrong group: rules.expert_grads_reduced_over_expert_dp; its TP2+SP row is ETP = TP).

    python scripts/measure_trajectory_band.py --out tests/data/trajectory_band.json     # 3-5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "backends"))

from megatron_ranks import run_ranks, smoke_request  # noqa: E402

from sweeper.config.schema import ClusterConfig  # noqa: E402
from sweeper.models.catalog import preset  # noqa: E402
from sweeper.plan.rules import check  # noqa: E402
from sweeper.search.decide.verdicts import trajectory_rel_errs  # noqa: E402
from sweeper.space.layout import Layout  # noqa: E402

SEQ = 64
GBS = 8  # the quickstart's global batch
CLUSTER = ClusterConfig(nodes=1, gpus_per_node=4, simulate=True)  # what the rules hold the layouts to


def layouts(model: str, precision: str) -> dict[str, Layout]:
    two = dict(world_size=2, gbs=GBS, precision=precision)
    out = {"tp2-sp": Layout(tp=2, sp=True, **two), "pp2": Layout(pp=2, **two), "dp2": Layout(**two)}  # type: ignore[arg-type]
    four = dict(world_size=4, gbs=GBS, precision=precision)
    if model == "tiny-moe":
        # TP2+SP with the experts over the same TP ranks (ETP = TP, Megatron-LM's default), and at ETP 1 (Bridge's
        # default) where the installed megatron-core reduces its experts' gradients right (the rules say).
        out["tp2-sp"] = Layout(tp=2, etp=2, sp=True, **two)  # type: ignore[arg-type]
        out["tp2-sp-etp1"] = Layout(tp=2, sp=True, **two)  # type: ignore[arg-type]
        out["ep2"] = Layout(ep=2, **two)  # type: ignore[arg-type]
        out["ep2-dp2"] = Layout(ep=2, **four)  # type: ignore[arg-type]
    else:
        out["tp2-sp-dp2"] = Layout(tp=2, sp=True, **four)  # type: ignore[arg-type]
    return out


def trajectory(root: Path, name: str, model: str, layout: Layout, steps: int, **kw: object) -> dict[str, list[float]]:
    request = smoke_request(root / name, layout, model, SEQ, steps=steps, **kw)
    reports = run_ranks(request, layout.world_size, timeout_s=900.0)
    bad = [r for r in reports if r is None or not r.ok]
    failed = f"{bad[0].failure_kind}: {bad[0].error}" if bad and bad[0] else "a rank died" if bad else None
    if failed:  # recorded with the steps it ran (a check after the steps may fail it), not counted as correct
        print(f"{model} {name}: failed ({failed})", flush=True)
    first = next((r for r in reports if r is not None and r.losses), None)
    run = {"losses": list(first.losses), "grad_norms": list(first.grad_norms)} if first else {}
    return {**run, "failed": failed} if failed else run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-gpt", "tiny-moe"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=12)  # the quickstart's confirmation: 2 x training.steps
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    started = time.time()
    table: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            root = Path(tmp) / model
            reference = root / "reference"
            trajectory(root, "make-reference", model, Layout(world_size=1, gbs=GBS, precision="fp32"), 0,
                       reference_checkpoint=str(reference), make_reference=True)
            for precision in args.precisions:
                base = trajectory(root, f"one-{precision}", model, Layout(world_size=1, gbs=GBS, precision=precision),
                                  args.steps, reference_checkpoint=str(reference))
                rows, refused = {}, {}
                for name, layout in layouts(model, precision).items():
                    reasons = check(preset(model), layout, CLUSTER, SEQ)
                    if reasons:
                        refused[name] = {"layout": layout.short(), "reason": reasons[0]}
                        print(f"{model} {precision} {layout.short()}: refused by the rules ({reasons[0]})", flush=True)
                        continue
                    run = trajectory(root, f"{name}-{precision}", model, layout, args.steps,
                                     reference_checkpoint=str(reference))
                    errs = trajectory_rel_errs(run.get("losses", []), run.get("grad_norms", []), base["losses"],
                                               base["grad_norms"])
                    if len(errs) < args.steps:
                        print(f"{model} {precision} {layout.short()}: ran {len(errs)} steps, left out", flush=True)
                        continue
                    rows[name] = {"layout": layout.short(), "max_rel_err": max(errs), "per_step": errs, **run}
                    print(f"{model} {precision} {layout.short()}: max {max(errs):.3g} "
                          f"(last step {errs[-1]:.3g})", flush=True)
                table.setdefault(model, {})[precision] = {"reference_layout": base, "layouts": rows,
                                                          **({"refused": refused} if refused else {})}
    # The band's basis: layouts that passed every check of their run (one that failed is not known-correct).
    worst = {p: max(row["max_rel_err"] for m in table.values() for row in m[p]["layouts"].values()
                    if not row.get("failed")) for p in args.precisions}
    out = {
        "command": "python " + " ".join(sys.argv),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(), "python": platform.python_version(),
        "torch": version("torch"), "megatron-core": version("megatron-core"),
        "seq_length": SEQ, "global_batch_size": GBS, "steps": args.steps, "seconds": round(time.time() - started),
        "worst_max_rel_err": worst, "models": table,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"worst: {worst}")


if __name__ == "__main__":
    main()
