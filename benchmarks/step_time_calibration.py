"""Does calibrating the step-time terms on a few measured layouts predict the others of the same model and machine?

Groups of several layouts of one model measured on one machine:
  - published: tests/data/measured_throughput.json and, where present, tests/data/measured_throughput_more.json
    (groups with at least 4 measured layouts; MFU or TFLOP/s per GPU turned into step time with Megatron's FLOPs
    formula, ``step_time.model_flops_per_token``);
  - measured here: the three CPU landscapes (tests/data/landscape_*.json; each layout's median step time, the
    host's cores shared by its ranks as in a simulated sweep).
For each group, every choice of ``--given`` measured layouts (all of them for a published group, ``--draws`` random
ones for a landscape) is fitted as a sweep would (``estimate.step_fit``), and the group's other layouts are predicted:
  - error: |predicted - measured| / measured of each held-out layout; median per group
  - order: the held-out pairs whose predicted order is the measured one (pairs closer than the group's measured
    noise are left out: nothing can order them)
  - against one factor: the same with the level alone (the calibration sweeper had before, one median ratio), and
    the distribution of (term-by-term error - one-factor error) per held-out layout
No group's layouts enter any fit but the draw's own: the estimator's constants are its defaults. Those defaults'
achievable_mfu and comm_efficiency are fitted on the published groups (benchmarks/first_guess.py, issue 46), so the
published groups' "uncalibrated" column is in sample; first_guess.py gives it held out.

    python benchmarks/step_time_calibration.py [--given 3] [--draws 40]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sweeper.config.load import load_config  # noqa: E402
from sweeper.config.schema import ClusterConfig  # noqa: E402
from sweeper.estimate import Estimator  # noqa: E402
from sweeper.estimate.devices import device_for  # noqa: E402
from sweeper.estimate.step_fit import StepFit, StepSample, fit_step  # noqa: E402
from sweeper.estimate.step_time import StepTerms, model_flops_per_token  # noqa: E402
from sweeper.models.catalog import resolve_model  # noqa: E402
from sweeper.models.spec import ModelSpec  # noqa: E402
from sweeper.space.layout import Layout  # noqa: E402

DATA = ROOT / "tests" / "data"
PUBLISHED = (DATA / "measured_throughput.json", DATA / "measured_throughput_more.json")
# A published number's own spread is not printed: a repeated large run varies by a few percent.
NOISE_FLOOR = 0.03
LANDSCAPES = ("landscape_quickstart.json", "landscape_dense.json", "landscape_quickstart_avx512bf16.json")


@dataclass
class Group:
    name: str
    points: list[tuple[str, StepTerms, float]]  # (layout, uncalibrated terms, measured step seconds)
    noise: float  # relative spread of a repeated measurement (0 where the source gives one number)
    kind: str


@dataclass
class PublishedRuns:
    """One published group: layouts of one model on one cluster, each with its measured step time (seconds)."""

    id: str
    source: str
    model: ModelSpec
    cluster: ClusterConfig
    seq_length: int
    runs: list[tuple[Layout, float]]


def published_runs(paths: tuple[Path, ...] = PUBLISHED) -> list[PublishedRuns]:
    """Every published group of ``paths``, its layouts that have a step time (MFU or TFLOP/s per GPU turned into one
    with Megatron's FLOPs formula; a run out of memory has none), however few."""
    out = []
    for path in paths:
        if not path.is_file():
            continue
        for g in json.loads(path.read_text())["groups"]:
            model, cluster, seq = resolve_model(g["model"]), ClusterConfig(**g["cluster"]), int(g["seq_length"])
            peak = device_for(cluster.gpu_kind, cluster.compute_capability).bf16_tflops * 1e12
            flops = model_flops_per_token(model, seq)
            runs = []
            for row in g["rows"]:
                m = row["measured"]
                layout = Layout.from_dict({"precision": "bf16", "recompute": "none", "distributed_optimizer": True,
                                           **row["layout"]})
                if "step_time_s" in m:
                    step = float(m["step_time_s"])
                elif "mfu" in m or "tflops_per_gpu" in m:
                    per_gpu = float(m["tflops_per_gpu"]) * 1e12 if "tflops_per_gpu" in m else float(m["mfu"]) * peak
                    step = layout.gbs * seq * flops / (per_gpu * layout.world_size)
                else:
                    continue  # out of memory: no time
                runs.append((layout, step))
            out.append(PublishedRuns(g["id"], g["source"], model, cluster, seq, runs))
    return out


def published_groups() -> list[Group]:
    out = []
    for g in published_runs():
        estimator = Estimator(g.model, g.cluster, g.seq_length)
        points = []
        for layout, step in g.runs:
            terms = estimator(layout).step_terms
            assert terms is not None
            points.append((layout.short(), terms, step))
        if len(points) >= 4:
            out.append(Group(g.id, points, 0.0, "published"))
    return out


def landscape_groups() -> list[Group]:
    out = []
    for name in LANDSCAPES:
        table = json.loads((DATA / name).read_text())
        cfg = load_config(ROOT / table["space"])
        estimator = Estimator.for_config(cfg, host_cores=table["machine"]["cores"])
        points = []
        for entry in table["layouts"].values():
            times = [t["step_time_s"] for t in entry["trials"] if t["status"] == "passed" and t["step_time_s"]]
            if times and len(times) == len(entry["trials"]):
                layout = Layout.from_dict(entry["layout"])
                terms = estimator(layout).step_terms
                assert terms is not None
                points.append((layout.short(), terms, statistics.median(times)))
        out.append(Group(name.removesuffix(".json"), points, float(table["noise_cv_median"]), "CPU landscape"))
    return out


def level_only(samples: list[StepSample]) -> StepFit:
    """One factor for the whole prediction: the median measured / predicted ratio."""
    return StepFit(level=statistics.median(s.measured_s / s.terms.seconds() for s in samples), factors={})


def evaluate(group: Group, given: int, draws: int, rng: random.Random) -> dict[str, Any]:
    n = len(group.points)
    combos = list(itertools.combinations(range(n), given))
    if len(combos) > draws:
        combos = rng.sample(combos, draws)
    errors, one_factor, uncalibrated, diffs, vs_raw, ordered, pairs = [], [], [], [], [], 0, 0
    for combo in combos:
        samples = [StepSample(group.points[i][1], group.points[i][2]) for i in combo]
        fit, one = fit_step(samples), level_only(samples)
        held = [p for i, p in enumerate(group.points) if i not in combo]
        predicted = {name: terms.seconds(fit.factor) for name, terms, _ in held}
        for name, terms, measured in held:
            err = abs(predicted[name] / measured - 1)
            err_one = abs(terms.seconds(one.factor) / measured - 1)
            errors.append(err)
            one_factor.append(err_one)
            uncalibrated.append(abs(terms.seconds() / measured - 1))
            diffs.append(err - err_one)
            vs_raw.append(err - uncalibrated[-1])
        for (a, _, ma), (b, _, mb) in itertools.combinations(held, 2):
            if abs(ma / mb - 1) <= max(group.noise, 0.01):
                continue
            pairs += 1
            ordered += (predicted[a] - predicted[b]) * (ma - mb) > 0
    noise = max(group.noise, NOISE_FLOOR)

    def spread(values: list[float]) -> dict[str, float]:
        q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        return {"p10": q[0], "median": statistics.median(values), "p90": q[-1], "max": max(values),
                "share_worse_by_more_than_noise": sum(d > noise for d in values) / len(values)}

    return {
        "group": group.name, "kind": group.kind, "layouts": n, "draws": len(combos),
        "median_error": statistics.median(errors), "median_error_one_factor": statistics.median(one_factor),
        "median_error_uncalibrated": statistics.median(uncalibrated),
        "pairs_in_order": ordered / pairs if pairs else None, "pairs": pairs,
        "minus_one_factor": spread(diffs), "minus_uncalibrated": spread(vs_raw), "noise": noise,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--given", type=int, default=3, help="measured layouts per fit")
    parser.add_argument("--draws", type=int, default=40, help="fits per group at most (random choices)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(0)
    groups = published_groups() + landscape_groups()
    results = [evaluate(g, args.given, args.draws, rng) for g in groups if len(g.points) > args.given]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"given {args.given} measured layouts of a group, the others predicted (median over held-out layouts):")
    def spread(w: dict[str, float]) -> str:
        return (f"p10 {100 * w['p10']:+.1f} median {100 * w['median']:+.1f} p90 {100 * w['p90']:+.1f} max "
                f"{100 * w['max']:+.1f} points, worse by more than the noise on "
                f"{100 * w['share_worse_by_more_than_noise']:.0f}%")

    for r in results:
        order = "n/a" if r["pairs_in_order"] is None else f"{100 * r['pairs_in_order']:.0f}% of {r['pairs']}"
        print(f"  {r['group']} ({r['kind']}, {r['layouts']} layouts, {r['draws']} fits, noise "
              f"{100 * r['noise']:.1f}%): error {100 * r['median_error']:.1f}% term by term vs "
              f"{100 * r['median_error_one_factor']:.1f}% one factor vs {100 * r['median_error_uncalibrated']:.1f}% "
              f"uncalibrated; pairs in measured order {order}\n"
              f"      term-by-term minus uncalibrated error per held-out layout: {spread(r['minus_uncalibrated'])}\n"
              f"      term-by-term minus one-factor error per held-out layout:  {spread(r['minus_one_factor'])}")


if __name__ == "__main__":
    main()
