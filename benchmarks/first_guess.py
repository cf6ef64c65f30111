"""How far is the estimator's step time before any trial, and do defaults fitted on published runs bring it closer?

The published groups of benchmarks/step_time_calibration.py (``published_runs``: every group with a step time,
the three-layout Table 3 groups and Korthikanti's two end-to-end iterations included, which the calibration
benchmark skips as too small to fit 3 and predict others) are predicted with no trial at all: the estimator's
constants alone. A few of those constants are fitted (``scipy.optimize.least_squares`` on log(predicted /
measured) step time, bounded to physical ranges) and checked leave-one-family-out:
  - a family is one source's groups of one model (Parallel Folding's Table 3 and Table 4 rows of Mixtral 8x22B are
    one family; MegaScale's two batch sizes of GPT-175B another): held out together, so a held-out group is never
    a near-duplicate of a fitted one (the same layouts at another batch size);
  - each family is predicted with the constants fitted on all the others; every family counts the same in a fit
    (its residuals weighted by 1 / sqrt(its layouts)), so the 15-layout Qwen2 group does not outvote the 2-layout
    Korthikanti one;
  - error: |predicted - measured| / measured per held-out layout (median per group, and over all held-out layouts);
  - order: the pairs of a group's layouts whose predicted order is the measured one; pairs closer than the noise
    (NOISE_FLOOR, 3%: a repeated large run varies by a few percent) are left out, as in step_time_calibration.
"Before" is the same with the estimator's defaults (or ``--before``). Last, the constants fitted on all families:
what the defaults are set from.

Expert dispatch (issue 52): tests/data/measured_throughput_dispatch.json holds published runs that name their token
dispatcher (NVIDIA's Megatron-MoE-ModelZoo, DeepEP and alltoall on 256 H100; sources in the file). They enter no fit:
they are predicted with the defaults and with the constants fitted on all the families above. The errors are then
given per dispatcher over the layouts whose expert-parallel group spans nodes (in Megatron's expert rank order, ETP
fastest then EP: ETP x EP above a node's GPUs), where the ``ep`` term's inter-node bytes decide: the families' held-out
rows (Parallel Folding's name no dispatcher and ran Megatron's default, alltoall) and the dispatch runs. Last, the
figure the issue starts from: Qwen3-30B-A3B on 2 x 8 H100 at EP16, predicted step and ``ep`` term per dispatcher.

FP8 (issue 52): tests/data/measured_throughput_fp8.json holds published FP8 / MXFP8 runs with their layouts
(torchtitan's Llama 3.1 8B on 8 H100, tensorwise, with its BF16 twin; DeepSeek-V3's report on 2048 H800, blockwise;
Megatron-LM's DeepSeek-V3 on 256 GB200, MXFP8; sources in the file). On them ``achievable_mfu_fp8`` (the fraction of
the FP8 peak the dense GEMMs reach, every FP8 and MXFP8 recipe's) and ``achievable_mfu_fp8_experts`` (the routed
experts' grouped GEMMs) are fitted the same way, one family held out at a time, the BF16 constants left at their
defaults; a row with a BF16 twin (the same layout in BF16) is scored on its FP8 / BF16 step ratio, so the system's own
level cancels. The errors are given per precision value (recipe). Each recipe has one run, so a recipe's own term
(blockwise's GEMM factor, tensorwise's amax pass) cannot be told apart from the efficiencies: those stay the
assumptions step_time names.

Fitted by default (``--fit``): ``achievable_mfu`` (every compute term: a quarter to nine tenths of each published
step) and ``comm_efficiency`` (every NCCL term: TP, EP, DP/EDP, pipeline point-to-point). The rest do not move these
runs or are not seen in them: kernel launches hide behind blocks this large, the runs overlap no DP traffic
(Megatron-LM's default), no CP, no FP8, no all-to-all overlap; the link latency matters only at many times NCCL's
(``--fit ...,link_latency_us`` runs to its 50 us bound and predicts the held-out families worse).

    python benchmarks/first_guess.py [--fit achievable_mfu,comm_efficiency] [--one-fp8-efficiency] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_time_calibration import DATA, NOISE_FLOOR, PublishedRuns, published_runs

from sweeper.config.estimator import EstimatorConstants
from sweeper.config.schema import ClusterConfig
from sweeper.estimate import Estimator
from sweeper.estimate.step_time import EP
from sweeper.models.catalog import resolve_model
from sweeper.space.layout import Layout

# Published runs that name their MoE token dispatcher (issue 52): a check only, in no fit.
DISPATCH_RUNS = DATA / "measured_throughput_dispatch.json"
# Published FP8 / MXFP8 runs (issue 52): the FP8 efficiencies are fitted on them.
FP8_RUNS = DATA / "measured_throughput_fp8.json"

# The physical range of each constant the fit may move: the fraction of the dense BF16 peak a block's GEMMs and
# attention run at (cuBLAS reaches 70-80% on large Hopper GEMMs, no Megatron run reaches less than a fifth), the
# fraction of the link's bandwidth a NCCL collective reaches (bus bandwidth / link bandwidth, at most 1), the
# per-hop latency and the per-kernel launch time in microseconds.
BOUNDS: dict[str, tuple[float, float]] = {
    "achievable_mfu": (0.2, 0.85),
    "achievable_mfu_fp8": (0.2, 0.85),  # of the FP8 peak: the same physical range as BF16's of its own
    "achievable_mfu_fp8_experts": (0.1, 0.85),  # grouped GEMMs of a few rows per expert may reach far less
    "comm_efficiency": (0.3, 1.0),
    "link_latency_us": (0.0, 50.0),
    "kernel_launch_us": (0.0, 30.0),
    "dp_comm_overlap": (0.0, 1.0),
}
FITTED = ("achievable_mfu", "comm_efficiency")
FP8_FITTED = ("achievable_mfu_fp8", "achievable_mfu_fp8_experts")


def paper(g: PublishedRuns) -> str:
    """The source of a group: its arXiv number (else the source's first words)."""
    found = re.search(r"arXiv (\d{4}\.\d{4,5})", g.source)
    return found.group(1) if found else g.source.split(",")[0]


def family(g: PublishedRuns) -> str:
    """A source's runs of one model: the paper and the model's name."""
    return f"{paper(g)}/{g.model.name}"


def predict(groups: Sequence[PublishedRuns], constants: EstimatorConstants) -> list[list[float]]:
    """Each group's predicted step times (seconds) with ``constants``, no calibration."""
    out = []
    for g in groups:
        estimator = Estimator(g.model, g.cluster, g.seq_length, constants=constants)
        steps = [estimator(layout).step_time_s for layout, _ in g.runs]
        assert all(s is not None for s in steps), g.id  # every published layout ran: none is priced as unrunnable
        out.append([float(s) for s in steps if s is not None])
    return out


def with_values(base: EstimatorConstants, names: Sequence[str], values: Sequence[float] | np.ndarray,
                ) -> EstimatorConstants:
    return base.model_copy(update={n: float(v) for n, v in zip(names, values, strict=True)})


def fit(groups: Sequence[PublishedRuns], names: Sequence[str], base: EstimatorConstants) -> EstimatorConstants:
    """``names`` fitted to ``groups`` on log(predicted / measured), each family weighing the same."""
    sizes: dict[str, int] = {}
    for g in groups:
        sizes[family(g)] = sizes.get(family(g), 0) + len(g.runs)
    weights = np.array([1 / math.sqrt(sizes[family(g)]) for g in groups for _ in g.runs])
    measured = np.array([s for g in groups for _, s in g.runs])

    def residuals(x: np.ndarray) -> np.ndarray:
        predicted = np.array([p for ps in predict(groups, with_values(base, names, x)) for p in ps])
        return weights * np.log(predicted / measured)

    lo, hi = zip(*(BOUNDS[n] for n in names), strict=True)
    x0 = np.clip([getattr(base, n) for n in names], lo, hi)
    # diff_step: a relative step well above the estimator's rounding (a step time is a sum of many small terms).
    result = least_squares(residuals, x0, bounds=(lo, hi), diff_step=1e-4, x_scale="jac")
    return with_values(base, names, result.x)


def score(g: PublishedRuns, predicted: Sequence[float]) -> dict[str, Any]:
    """A group's predicted / measured step time and error per layout, and the pairs (apart by more than the noise)
    predicted in the measured order."""
    ratios = [p / s for (_, s), p in zip(g.runs, predicted, strict=True)]
    errors = [abs(r - 1) for r in ratios]
    pairs = ordered = 0
    for (ma, pa), (mb, pb) in itertools.combinations(zip((s for _, s in g.runs), predicted, strict=True), 2):
        if abs(ma / mb - 1) <= NOISE_FLOOR:
            continue
        pairs += 1
        ordered += (pa - pb) * (ma - mb) > 0
    return {"ratios": ratios, "errors": errors, "pairs": pairs, "ordered": ordered}


def cross_node_dispatcher(g: PublishedRuns, layout: Layout) -> str | None:
    """The token dispatcher of a layout whose expert-parallel group spans nodes (ETP x EP ranks, consecutive in
    Megatron's expert rank order, more than a node holds); None for a dense model or EP within one node."""
    if not g.model.is_moe or layout.ep * layout.etp <= g.cluster.gpus_per_node:
        return None
    return layout.moe_token_dispatcher or "alltoall"


def leave_one_out(groups: list[PublishedRuns], names: Sequence[str], before: EstimatorConstants,
                  by: Callable[[PublishedRuns], str] = family) -> list[dict[str, Any]]:
    """Each family (or whatever ``by`` names) predicted with ``names`` fitted on the others."""
    rows = []
    for held in sorted({by(g) for g in groups}):
        fitted_on = [g for g in groups if by(g) != held]
        out = [g for g in groups if by(g) == held]
        constants = fit(fitted_on, names, before)
        for g, p_before, p_after in zip(out, predict(out, before), predict(out, constants), strict=True):
            rows.append({"held_out": held, "group": g.id, "layouts": len(g.runs),
                         "fitted": {n: getattr(constants, n) for n in names},
                         "cross_node_dispatchers": [cross_node_dispatcher(g, layout) for layout, _ in g.runs],
                         "before": score(g, p_before), "after": score(g, p_after)})
    return rows


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Over all held-out layouts: the median error, the pairs in order, the range of measured / predicted throughput
    (= predicted / measured step time) and the level's log-normal sigma: the root mean square of each group's median
    log(predicted / measured), how far a whole sweep's first guess lies off; and each layout's spread about its
    group's level: the root mean square of its log ratio less its group's median (the rehearsal's LAYOUT_SIGMA)."""
    errors = [e for r in rows for e in r[key]["errors"]]
    ratios = [x for r in rows for x in r[key]["ratios"]]
    levels = [statistics.median(math.log(x) for x in r[key]["ratios"]) for r in rows]
    about = [math.log(x) - level for r, level in zip(rows, levels, strict=True) for x in r[key]["ratios"]]
    pairs = sum(r[key]["pairs"] for r in rows)
    return {"median_error": statistics.median(errors), "layouts": len(errors),
            "throughput_measured_over_predicted": (min(ratios), max(ratios)),
            "level_sigma": math.sqrt(sum(v * v for v in levels) / len(levels)),
            "layout_sigma": math.sqrt(sum(v * v for v in about) / len(about)),
            "median_of_group_medians": statistics.median(statistics.median(r[key]["errors"]) for r in rows),
            "worst_group_median": max(statistics.median(r[key]["errors"]) for r in rows),
            "pairs_in_order": sum(r[key]["ordered"] for r in rows) / pairs if pairs else None, "pairs": pairs}


def by_dispatcher(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """Per token dispatcher, the median held-out error over the layouts whose expert-parallel group spans nodes."""
    errors: dict[str, list[float]] = {}
    for r in rows:
        for dispatcher, error in zip(r["cross_node_dispatchers"], r[key]["errors"], strict=True):
            if dispatcher is not None:
                errors.setdefault(dispatcher, []).append(error)
    return {d: {"median_error": statistics.median(e), "layouts": len(e)} for d, e in sorted(errors.items())}


def bf16_twins(path: Path = FP8_RUNS) -> dict[str, dict[int, int]]:
    """Per group of ``path``, each FP8 row's BF16 row of the same layout (row indices among the rows with a step
    time, as ``published_runs`` keeps them), where the source has one (the row's ``bf16_twin``: that row's method)."""
    out: dict[str, dict[int, int]] = {}
    for g in json.loads(path.read_text())["groups"]:
        timed = [r for r in g["rows"] if {"step_time_s", "mfu", "tflops_per_gpu"} & set(r["measured"])]
        index = {r["method"]: i for i, r in enumerate(timed)}
        out[g["id"]] = {i: index[r["bf16_twin"]] for i, r in enumerate(timed) if "bf16_twin" in r}
    return out


def fp8_ratios(g: PublishedRuns, predicted: Sequence[float], twins: dict[int, int]) -> dict[str, list[Any]]:
    """A group's scored rows: each FP8 row's predicted / measured step, relative to its BF16 twin's where it has one
    (the system's own level cancels: what remains is the FP8 speed-up); a row that is a twin is a reference only."""
    references = set(twins.values())
    precisions, ratios = [], []
    for i, ((layout, measured), p) in enumerate(zip(g.runs, predicted, strict=True)):
        if i in references:
            continue
        ratio = p / measured
        if i in twins:
            ratio /= predicted[twins[i]] / g.runs[twins[i]][1]
        precisions.append(layout.precision)
        ratios.append(ratio)
    return {"precisions": precisions, "ratios": ratios, "errors": [abs(r - 1) for r in ratios]}


def one_fp8_efficiency(constants: EstimatorConstants) -> EstimatorConstants:
    """The estimator before the routed experts had an FP8 efficiency of their own: theirs is the dense GEMMs'."""
    return constants.model_copy(update={"achievable_mfu_fp8_experts": constants.achievable_mfu_fp8})


def fp8_fit(groups: Sequence[PublishedRuns], twins: dict[str, dict[int, int]], base: EstimatorConstants,
            one: bool = False) -> EstimatorConstants:
    """FP8_FITTED fitted to ``groups`` on log of ``fp8_ratios``, each family weighing the same; ``one``: a single
    efficiency for dense and expert GEMMs (``one_fp8_efficiency``)."""
    names = FP8_FITTED[:1] if one else FP8_FITTED
    tie = one_fp8_efficiency if one else (lambda c: c)
    sizes: dict[str, int] = {}
    for g in groups:
        sizes[family(g)] = sizes.get(family(g), 0) + len(g.runs) - len(set(twins[g.id].values()))
    weights = np.array([1 / math.sqrt(sizes[family(g)]) for g in groups
                        for _ in range(len(g.runs) - len(set(twins[g.id].values())))])

    def residuals(x: np.ndarray) -> np.ndarray:
        predicted = predict(groups, tie(with_values(base, names, x)))
        ratios = [r for g, p in zip(groups, predicted, strict=True) for r in fp8_ratios(g, p, twins[g.id])["ratios"]]
        return weights * np.log(ratios)

    lo, hi = zip(*(BOUNDS[n] for n in names), strict=True)
    x0 = np.clip([getattr(base, n) for n in names], lo, hi)
    result = least_squares(residuals, x0, bounds=(lo, hi), diff_step=1e-4, x_scale="jac")
    return tie(with_values(base, names, result.x))


def by_precision(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """Per precision value (an FP8 recipe), the median held-out error over its scored rows."""
    errors: dict[str, list[float]] = {}
    for r in rows:
        for precision, error in zip(r[key]["precisions"], r[key]["errors"], strict=True):
            errors.setdefault(precision, []).append(error)
    return {p: {"median_error": statistics.median(e), "layouts": len(e)} for p, e in sorted(errors.items())}


def fp8_section(before: EstimatorConstants, one: bool = False) -> dict[str, Any]:
    """FP8_FITTED fitted on the published FP8 runs one family out at a time (the BF16 constants at ``before``'s), the
    errors per precision value, and the fit on all of them: what the FP8 efficiencies' defaults are set from.
    ``one``: the same with a single efficiency for dense and expert GEMMs, as before issue 52 split them."""
    if one:
        before = one_fp8_efficiency(before)
    groups = [g for g in published_runs((FP8_RUNS,)) if g.runs]
    twins = bf16_twins()
    rows = []
    for held in sorted({family(g) for g in groups}):
        constants = fp8_fit([g for g in groups if family(g) != held], twins, before, one)
        out = [g for g in groups if family(g) == held]
        for g, p_before, p_after in zip(out, predict(out, before), predict(out, constants), strict=True):
            rows.append({"held_out": held, "group": g.id, "fitted": {n: getattr(constants, n) for n in FP8_FITTED},
                         "before": fp8_ratios(g, p_before, twins[g.id]),
                         "after": fp8_ratios(g, p_after, twins[g.id])})
    everything = fp8_fit(groups, twins, before, one)
    return {"held_out": rows, "before_constants": {n: getattr(before, n) for n in FP8_FITTED},
            "by_precision": {k: by_precision(rows, k) for k in ("before", "after")},
            "fitted_on_all": {n: getattr(everything, n) for n in FP8_FITTED},
            "in_sample": {g.id: fp8_ratios(g, p, twins[g.id])
                          for g, p in zip(groups, predict(groups, everything), strict=True)}}


# The issue-52 example: Qwen3-30B-A3B on 2 x 8 H100 (NVLink 450, one 400 Gb/s NIC per GPU), TP1 PP1 EP16, GBS 1024.
QWEN3_EP16 = {"gpus": 16, "tp": 1, "pp": 1, "ep": 16, "etp": 1, "mbs": 1, "gbs": 1024, "precision": "bf16",
              "recompute": "none", "distributed_optimizer": True}
QWEN3_CLUSTER = ClusterConfig(nodes=2, gpus_per_node=8, gpu_kind="h100", compute_capability="9.0",
                              intra_node_bandwidth_gbs=450, inter_node_bandwidth_gbs=50)


def qwen3_ep16(constants: EstimatorConstants) -> dict[str, dict[str, float]]:
    """Predicted step time and ``ep`` term (seconds) of QWEN3_EP16 per dispatcher, with and without A2A overlap."""
    estimator = Estimator(resolve_model("qwen3-30b-a3b"), QWEN3_CLUSTER, 4096, constants=constants)
    out = {}
    for dispatcher in ("alltoall", "allgather", "flex:deepep", "flex:hybridep"):
        for overlap in (False, True) if dispatcher != "allgather" else (False,):
            e = estimator(Layout.from_dict({**QWEN3_EP16, "moe_token_dispatcher": dispatcher,
                                            "moe_a2a_overlap": overlap}))
            assert e.step_time_s is not None
            out[dispatcher + (" +a2a_overlap" if overlap else "")] = {"step_s": e.step_time_s,
                                                                     "ep_s": e.step_time_terms_s.get(EP, 0.0)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", default=",".join(FITTED),
                        help=f"estimator constants to fit, comma-separated (of {', '.join(BOUNDS)})")
    parser.add_argument("--before", default="", help="constants of the 'before' column, e.g. "
                        "achievable_mfu=0.4,comm_efficiency=0.7 (default: the estimator's defaults)")
    parser.add_argument("--hold-out", choices=("family", "paper"), default="family",
                        help="what is held out together: a source's runs of one model, or the whole source (a stricter "
                        "check: the A100 papers predict the H100 one and back)")
    parser.add_argument("--one-fp8-efficiency", action="store_true", help="FP8 section: one efficiency for dense "
                        "and routed-expert GEMMs (achievable_mfu_fp8_experts tied to achievable_mfu_fp8), as before")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    names = [n for n in args.fit.split(",") if n]
    if unknown := [n for n in names if n not in BOUNDS]:
        parser.error(f"no bounds for {unknown}: one of {sorted(BOUNDS)}")
    before = EstimatorConstants(**{k: float(v) for k, v in (kv.split("=") for kv in args.before.split(",") if kv)})
    groups = [g for g in published_runs() if g.runs]
    rows = leave_one_out(groups, names, before, family if args.hold_out == "family" else paper)
    everything = fit(groups, names, before)
    in_sample = [score(g, p) for g, p in zip(groups, predict(groups, everything), strict=True)]
    checks = [g for g in published_runs((DISPATCH_RUNS,)) if g.runs]
    check_rows: list[dict[str, Any]] = [{"held_out": "in no fit", "group": g.id, "layouts": len(g.runs),
                   "fitted": {n: getattr(everything, n) for n in names},
                   "cross_node_dispatchers": [cross_node_dispatcher(g, layout) for layout, _ in g.runs],
                   "before": score(g, p_before), "after": score(g, p_after)}
                  for g, p_before, p_after in zip(checks, predict(checks, before), predict(checks, everything),
                                                  strict=True)]
    result = {
        "fitted_constants": names, "before_constants": {n: getattr(before, n) for n in names},
        "held_out": rows, "before": summary(rows, "before"), "after": summary(rows, "after"),
        "fitted_on_all": {n: getattr(everything, n) for n in names},
        "in_sample_median_error": statistics.median(e for s in in_sample for e in s["errors"]),
        "dispatch_checks": check_rows,
        "cross_node_by_dispatcher": {k: by_dispatcher(rows + check_rows, k) for k in ("before", "after")},
        "qwen3_30b_a3b_ep16": qwen3_ep16(before),
        "fp8": fp8_section(before, args.one_fp8_efficiency),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0

    def consts(values: dict[str, float]) -> str:
        return ", ".join(f"{n} {v:.3g}" for n, v in values.items())

    def order(s: dict[str, Any]) -> str:
        return f"{100 * s['ordered'] / s['pairs']:.0f}% of {s['pairs']}" if s["pairs"] else "no pair"

    print(f"step time before any trial against {sum(len(g.runs) for g in groups)} published runs in {len(groups)} "
          f"groups, {len({family(g) for g in groups})} families of {len({paper(g) for g in groups})} papers; each "
          f"{args.hold_out} predicted with {', '.join(names)} fitted on the others\n"
          f"before: {consts(result['before_constants'])}")
    for r in rows:
        b, a = r["before"], r["after"]
        print(f"  {r['group']} ({r['layouts']} layouts; fitted without {r['held_out']}: {consts(r['fitted'])})\n"
              f"      median error {100 * statistics.median(b['errors']):.1f}% -> "
              f"{100 * statistics.median(a['errors']):.1f}%, pairs in measured order {order(b)} -> {order(a)}")
    for key in ("before", "after"):
        s = result[key]
        pairs = "n/a" if s["pairs_in_order"] is None else f"{100 * s['pairs_in_order']:.1f}% of {s['pairs']}"
        print(f"{key:6}: median error over {s['layouts']} held-out layouts {100 * s['median_error']:.1f}% (median "
              f"of group medians {100 * s['median_of_group_medians']:.1f}%, worst group "
              f"{100 * s['worst_group_median']:.1f}%); pairs in measured order {pairs}\n"
              f"        measured / predicted throughput {s['throughput_measured_over_predicted'][0]:.2f}-"
              f"{s['throughput_measured_over_predicted'][1]:.2f}; level (each group's median log(predicted / "
              f"measured)) sigma {s['level_sigma']:.3f}, each layout about its group's level sigma "
              f"{s['layout_sigma']:.3f}")
    print(f"fitted on all families: {consts(result['fitted_on_all'])} (median error in sample "
          f"{100 * result['in_sample_median_error']:.1f}%)")
    for r in check_rows:
        b, a = r["before"], r["after"]
        print(f"  {r['group']} ({r['layouts']} layouts, in no fit; with the defaults -> fitted on all families)\n"
              f"      median error {100 * statistics.median(b['errors']):.1f}% -> "
              f"{100 * statistics.median(a['errors']):.1f}%, pairs in measured order {order(b)} -> {order(a)}; "
              f"predicted / measured throughput {', '.join(f'{1 / x:.2f}' for x in b['ratios'])} -> "
              f"{', '.join(f'{1 / x:.2f}' for x in a['ratios'])}")
    print("held-out layouts whose expert-parallel group spans nodes, per dispatcher (median error with the 'before' "
          "constants -> fitted on the others):")
    crossing = result["cross_node_by_dispatcher"]
    for dispatcher, b in crossing["before"].items():
        a = crossing["after"][dispatcher]
        print(f"  {dispatcher}: {b['layouts']} layouts, {100 * b['median_error']:.1f}% -> "
              f"{100 * a['median_error']:.1f}%")
    print("predicted (uncalibrated, the 'before' constants) Qwen3-30B-A3B on 2 x 8 H100, TP1 PP1 EP16, GBS 1024, seq "
          "4096:")
    for name, v in result["qwen3_30b_a3b_ep16"].items():
        print(f"  {name}: step {v['step_s']:.1f} s, ep term {v['ep_s']:.1f} s")
    fp8 = result["fp8"]
    fitted_fp8 = "achievable_mfu_fp8 (one for dense and expert GEMMs)" if args.one_fp8_efficiency else ", ".join(
        FP8_FITTED)
    print(f"FP8: {fitted_fp8} fitted on the published FP8 runs, each family predicted with it fitted on the others "
          f"(BF16's constants the 'before' ones); before: {consts(fp8['before_constants'])}")
    for r in fp8["held_out"]:
        b, a = r["before"], r["after"]
        print(f"  {r['group']} ({', '.join(b['precisions'])}; fitted without it: {consts(r['fitted'])})\n"
              f"      median error {100 * statistics.median(b['errors']):.1f}% -> "
              f"{100 * statistics.median(a['errors']):.1f}%; measured / predicted throughput (predicted / measured "
              f"step, relative to the BF16 twin where there is one) {', '.join(f'{x:.2f}' for x in b['ratios'])} -> "
              f"{', '.join(f'{x:.2f}' for x in a['ratios'])}")
    print("  per precision (median held-out error, 'before' -> fitted on the others):")
    for precision, b in fp8["by_precision"]["before"].items():
        a = fp8["by_precision"]["after"][precision]
        print(f"    {precision}: {b['layouts']} layouts, {100 * b['median_error']:.1f}% -> "
              f"{100 * a['median_error']:.1f}%")
    fp8_in_sample = ", ".join(f"{g} {100 * statistics.median(scored['errors']):.1f}%"
                          for g, scored in fp8["in_sample"].items())
    print(f"  fitted on all FP8 families: {consts(fp8['fitted_on_all'])} (in sample: {fp8_in_sample})\n"
          f"  fp8:delayed and nvfp4 have no published run here; blockwise's GEMM factor and tensorwise's amax pass "
          f"stay assumptions (one run per recipe cannot tell them from the efficiencies)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
