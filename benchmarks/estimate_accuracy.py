"""Predicted vs measured per-GPU memory for every published case in tests/data/measured_memory.json.

For the pipeline rank each source reports, three comparisons where the source has the figure:
- model state: allocated memory between steps (weights + grads + optimizer, and the optimizer's FP32 grad copies
  when the grad buffer is BF16; no activations alive) against ``stage_memory(...).between_steps_gib``;
- peak allocated: ``max_memory_allocated`` against ``stage_memory(...).allocated_gib``;
- peak reserved: ``max_memory_reserved`` against ``stage_memory(...).reserved_gib(fragmentation)``: the model
  state as allocated plus the dynamic part (activations, transients, logits) x the allocator fragmentation.
Cases with unmodelled features are printed but kept out of the headlines. The order check counts the pairs of cases
whose measured peaks the prediction puts in the same order.
Calibration is checked leave-one-out: each modelled peak-allocated case is predicted with factors fitted
(``sweeper.estimate.calibration.fit``) on all the others.
Run: ``python benchmarks/estimate_accuracy.py`` (``--json`` for the numbers only).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from sweeper.config.run_settings import RunSettings
from sweeper.estimate import Calibration, EstimatorConstants, stage_memory
from sweeper.estimate.calibration import Sample, fit
from sweeper.estimate.estimator import memory_band, non_torch_gib
from sweeper.models.catalog import resolve_model
from sweeper.models.params import total_params
from sweeper.space.layout import Layout

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "measured_memory.json"
GOAL_MEDIAN, GOAL_MAX = 0.10, 0.20  # issue #3: peak memory within 10% median, no case worse than 20%
# The headline may not rest on small models (issue 13): errors are also reported per total-parameter class.
SIZE_CLASSES = (("< 7B", 0.0, 7e9), ("7B-30B", 7e9, 30e9), ("30B+", 30e9, float("inf")))
# Device memory as the driver reports it (nvidia-smi's total, MiB / 1024), by the cases' "gpu" text: every case ran,
# so none may be predicted out of memory. GB200's 186 GB read as 10^9 bytes (the smaller, stricter reading).
GPU_MEMORY_GIB = (("GB200", 186e9 / 2**30), ("GH200", 97871 / 1024), ("A100 64GB", 64.0), ("A100 80GB", 80.0),
                  ("H100 80GB", 81559 / 1024))


def compare(case: dict[str, Any]) -> dict[str, Any]:
    """Predicted and measured GiB of one case (absent measurements stay absent)."""
    constants = EstimatorConstants(**case.get("constants", {}))
    layout = Layout.from_dict(case["layout"])
    model = resolve_model(case["model"])
    run = RunSettings(**case.get("run", {}))
    stage = stage_memory(model, layout, int(case["seq_length"]), constants, run=run,
                         compute_capability=case.get("compute_capability"))[case["stage"]]
    predicted = {
        "parts": stage.parts,
        "allocated_gib": stage.between_steps_gib,
        "max_allocated_gib": stage.allocated_gib,
        "max_reserved_gib": stage.reserved_gib(constants.allocator_fragmentation),
    }
    measured = case["measured"]
    capacity = next((gib for name, gib in GPU_MEMORY_GIB if name in case["gpu"]), None)
    non_torch = non_torch_gib(layout, constants)
    need = predicted["max_reserved_gib"] + non_torch
    return {
        "capacity_gib": capacity,
        "predicted_oom": None if capacity is None else need > capacity,
        "pruned_even_at_band_low": None if capacity is None else (
            memory_band(predicted["max_reserved_gib"], constants)[0] + non_torch > capacity),
        "id": case["id"],
        "params": total_params(model),
        "layout": layout.short(),
        "modelled": not case.get("unmodelled"),
        "predicted": {k: v for k, v in predicted.items() if k in measured or k == "parts"},
        "measured": measured,
        "error": {k: (predicted[k] - measured[k]) / measured[k] for k in measured},
    }


def _summary(errors: list[float]) -> dict[str, float] | None:
    if not errors:
        return None
    return {"n": len(errors), "median": statistics.median(errors), "max": max(errors)}


def leave_one_out(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Median and worst error of the modelled peak-allocated cases, uncalibrated and calibrated on the others."""
    key = "max_allocated_gib"
    cases = [r for r in rows if r["modelled"] and key in r["measured"]]
    if len(cases) < 3:
        return None
    samples = [Sample(breakdown=r["predicted"]["parts"], fragmentation=1.0, predicted_step_s=None,
                      measured_peak_gib=r["measured"][key], measured_step_s=None) for r in cases]
    before, after, factors = [], [], []
    for i, sample in enumerate(samples):
        calibration = fit(samples[:i] + samples[i + 1:]).calibration
        factors.append(calibration.activation_factor)
        measured = float(sample.measured_peak_gib or 0.0)
        before.append(abs(sample.predicted_memory(Calibration()) - measured) / measured)
        after.append(abs(sample.predicted_memory(calibration) - measured) / measured)
    return {"n": len(cases), "before": _summary(before), "after": _summary(after),
            "activation_factor": statistics.median(factors)}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def abs_errors(key: str) -> list[float]:
        return [abs(r["error"][key]) for r in rows if key in r["error"] and r["modelled"]]

    peak = abs_errors("max_allocated_gib") + abs_errors("max_reserved_gib")
    pairs = [(a, b) for a, b in itertools.combinations([r for r in rows if r["modelled"]], 2)
             if "max_allocated_gib" in a["measured"] and "max_allocated_gib" in b["measured"]]
    same_order = sum(
        1 for a, b in pairs
        if (a["predicted"]["max_allocated_gib"] - b["predicted"]["max_allocated_gib"])
        * (a["measured"]["max_allocated_gib"] - b["measured"]["max_allocated_gib"]) > 0
    )
    peak_summary = _summary(peak)
    by_size = {}
    for name, lo, hi in SIZE_CLASSES:
        inside = [r for r in rows if r["modelled"] and lo <= r["params"] < hi]
        errors = [abs(r["error"][k]) for r in inside for k in ("max_allocated_gib", "max_reserved_gib")
                  if k in r["error"]]
        over = [r["error"][k] for r in inside for k in ("max_allocated_gib", "max_reserved_gib") if k in r["error"]]
        by_size[name] = {**(_summary(errors) or {"n": 0}), "cases": len(inside),
                         "worst_over_prediction": max(over, default=None),
                         "worst_under_prediction": min(over, default=None)}
    large = [abs(r["error"][k]) for r in rows if r["modelled"] and r["params"] >= 7e9
             for k in ("max_allocated_gib", "max_reserved_gib") if k in r["error"]]
    large_summary = _summary(large)
    with_capacity = [r for r in rows if r["capacity_gib"] is not None and r["modelled"]]
    return {
        "published_layouts_predicted_oom": [r["id"] for r in with_capacity if r["predicted_oom"]],
        "published_layouts_pruned": [r["id"] for r in with_capacity if r["pruned_even_at_band_low"]],
        "published_layouts_with_capacity": len(with_capacity),
        "peak_by_size": by_size,
        "peak_7b_plus": large_summary,
        "state": _summary(abs_errors("allocated_gib")),
        "peak_allocated": _summary(abs_errors("max_allocated_gib")),
        "peak_reserved": _summary(abs_errors("max_reserved_gib")),
        "peak": peak_summary,
        "order": {"pairs": len(pairs), "same_order": same_order},
        "calibration_leave_one_out": leave_one_out(rows),
        "goal_met": bool(peak_summary and peak_summary["median"] <= GOAL_MEDIAN and peak_summary["max"] <= GOAL_MAX),
        "goal_met_7b_plus": bool(large_summary and large_summary["median"] <= GOAL_MEDIAN
                                 and large_summary["max"] <= GOAL_MAX),
    }


def _cell(row: dict[str, Any], key: str) -> str:
    if key not in row["measured"]:
        return f"{'':>21}"
    return f"{row['predicted'][key]:6.2f} {row['measured'][key]:6.2f} {100 * row['error'][key]:+6.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows and the summary as JSON")
    args = parser.parse_args(argv)
    cases = json.loads(DATA.read_text())["cases"]
    rows = [compare(case) for case in cases]
    summary = summarise(rows)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
        return 0
    print(f"{'case':40} {'stage':>5}   {'model state GiB':^21}   {'peak allocated GiB':^21}   "
          f"{'peak reserved GiB':^21}")
    print(f"{'':40} {'':>5}   {'pred   meas     err':^21}   {'pred   meas     err':^21}   {'pred   meas     err':^21}")
    for case, row in zip(cases, rows):
        mark = "" if row["modelled"] else "  (unmodelled: " + "; ".join(case["unmodelled"]) + ")"
        print(f"{row['id']:40} {case['stage']:>5}   {_cell(row, 'allocated_gib')}   "
              f"{_cell(row, 'max_allocated_gib')}   {_cell(row, 'max_reserved_gib')}{mark}")
    print("\nabsolute errors over the modelled cases:")
    for name in ("state", "peak_allocated", "peak_reserved", "peak"):
        s = summary[name]
        if s:
            print(f"  {name:15} median {100 * s['median']:5.1f}%  max {100 * s['max']:5.1f}%  over {s['n']} figures")
    print("  peak by model size (total parameters):")
    for name, c in summary["peak_by_size"].items():
        if c["n"]:
            print(f"    {name:7} median {100 * c['median']:5.1f}%  max {100 * c['max']:5.1f}%  over {c['n']} figures "
                  f"of {c['cases']} cases; signed error from {100 * c['worst_under_prediction']:+.1f}% to "
                  f"{100 * c['worst_over_prediction']:+.1f}%")
    oom, pruned = summary["published_layouts_predicted_oom"], summary["published_layouts_pruned"]
    print(f"  modelled published layouts (all ran) predicted out of memory on their GPU: {len(oom)} of "
          f"{summary['published_layouts_with_capacity']}{' (' + ', '.join(oom) + ')' if oom else ''}; pruned even "
          f"at the error band's lower end: {len(pruned)}")
    order = summary["order"]
    print(f"  order: {order['same_order']} of {order['pairs']} pairs of measured peaks predicted in the same order")
    loo = summary["calibration_leave_one_out"]
    if loo:
        b, a = loo["before"], loo["after"]
        print(f"  calibration, leave-one-out over {loo['n']} peak-allocated cases: median {100 * b['median']:.1f}% -> "
              f"{100 * a['median']:.1f}%, max {100 * b['max']:.1f}% -> {100 * a['max']:.1f}% "
              f"(fitted activation factor ~{loo['activation_factor']:.2f})")
    print(f"goal (peak median <= {GOAL_MEDIAN:.0%}, max <= {GOAL_MAX:.0%}): "
          f"all cases {'met' if summary['goal_met'] else 'NOT met'}, "
          f"7B+ cases {'met' if summary['goal_met_7b_plus'] else 'NOT met'}")
    print(f"sources: {DATA.relative_to(DATA.parents[2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
