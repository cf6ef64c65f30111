"""Does the step-time model rank layouts as measured? Published throughput of several layouts of one model on one
cluster (tests/data/measured_throughput.json) against the estimator's predicted throughput.

Per group: every layout's measured MFU next to the predicted MFU (model FLOPs per token x predicted tokens/s per
GPU / the device's BF16 peak) and whether the estimator says it fits; then the pairs of measured layouts whose
order the prediction gets right, and whether layouts the source reports as out of memory are predicted not to fit.
Run: ``python benchmarks/step_time_ranking.py`` (``--json`` for the numbers only).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from sweeper.config.schema import ClusterConfig
from sweeper.estimate import Estimator
from sweeper.estimate.devices import device_for
from sweeper.estimate.step_time import model_flops_per_token
from sweeper.models.catalog import resolve_model
from sweeper.space.layout import Layout

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "measured_throughput.json"


def predict(group: dict[str, Any]) -> list[dict[str, Any]]:
    model = resolve_model(group["model"])
    cluster = ClusterConfig(**group["cluster"])
    seq = int(group["seq_length"])
    peak = device_for(cluster.gpu_kind, cluster.compute_capability).bf16_tflops * 1e12
    flops_per_token = model_flops_per_token(model, seq)
    estimator = Estimator(model, cluster, seq)
    rows = []
    for row in group["rows"]:
        layout = Layout.from_dict({"precision": "bf16", "recompute": "none", "distributed_optimizer": True,
                                   **row["layout"]})
        e = estimator(layout)
        tokens_per_gpu = (e.tokens_per_s or 0.0) / layout.world_size
        rows.append({
            "method": row["method"],
            "layout": layout.short(),
            "measured": row["measured"],
            "predicted": {"mfu": flops_per_token * tokens_per_gpu / peak, "tokens_per_s_per_gpu": tokens_per_gpu,
                          "memory_gib": e.memory_gib, "fits": e.fits},
        })
    return rows


def summarise(groups: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    pairs = same = 0
    oom = oom_predicted = 0
    for rows in groups.values():
        measured = [r for r in rows if "mfu" in r["measured"]]
        for a, b in itertools.combinations(measured, 2):
            pairs += 1
            same += (a["predicted"]["mfu"] - b["predicted"]["mfu"]) * (a["measured"]["mfu"] - b["measured"]["mfu"]) > 0
        for r in rows:
            if r["measured"].get("oom"):
                oom += 1
                oom_predicted += not r["predicted"]["fits"]
    return {"pairs": pairs, "same_order": same, "oom": oom, "oom_predicted": oom_predicted}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows and the summary as JSON")
    args = parser.parse_args(argv)
    data = json.loads(DATA.read_text())["groups"]
    groups = {g["id"]: predict(g) for g in data}
    summary = summarise(groups)
    if args.json:
        print(json.dumps({"groups": groups, "summary": summary}, indent=1))
        return 0
    for group in data:
        print(f"== {group['id']}\n   source: {group['source']}")
        print(f"   {'method':18} {'layout':40} {'measured':>9} {'pred MFU':>9} {'pred GiB':>9}  fits")
        for r in groups[group["id"]]:
            m = r["measured"]
            shown = "OOM" if m.get("oom") else f"{100 * m['mfu']:.1f}%"
            p = r["predicted"]
            print(f"   {r['method']:18} {r['layout']:40} {shown:>9} {100 * p['mfu']:8.1f}% {p['memory_gib']:9.1f}  "
                  f"{'yes' if p['fits'] else 'no'}")
    print(f"\norder: {summary['same_order']} of {summary['pairs']} pairs of measured layouts predicted in the "
          f"measured order; out of memory: {summary['oom_predicted']} of {summary['oom']} predicted not to fit")
    print(f"sources: {DATA.relative_to(DATA.parents[2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
