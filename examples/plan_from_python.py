"""Plan a search space from Python, as `python -m sweeper plan` does, and read the result as objects.

    python examples/plan_from_python.py                                    # search_spaces/nemotron.yaml
    python examples/plan_from_python.py search_spaces/deepseek_v2_lite.yaml
    python examples/plan_from_python.py nemotron.yaml --only "gpus=8,ep=8,precision=bf16"

Offline and instant like `plan`: no Ray, no GPU, no torch import. The same calls as the command (sweeper/cli.py
cmd_plan): ``load_config`` reads and validates the YAML, ``build_plan`` enumerates every layout, checks it against
Megatron's rules and predicts its memory and throughput; ``only_filter`` parses the ``--only`` syntax.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sweeper.config.load import load_config, resolve_space_path
from sweeper.errors import SweeperError
from sweeper.plan.assess import PlanEntry, build_plan, invalid_reasons
from sweeper.plan.space import only_filter

DEFAULT_SPACE = Path(__file__).resolve().parents[1] / "search_spaces" / "nemotron.yaml"


def describe(entry: PlanEntry) -> str:
    """One line: the layout's short name, its world size and the estimator's prediction."""
    p = entry.predicted
    assert p is not None  # valid layouts always carry a prediction
    low, high = p.memory_band_gib
    tokens = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s is not None else "-"
    return (f"{entry.layout.short():<44} {entry.layout.world_size:>4} GPUs  {tokens:>10} tokens/s  "
            f"{p.memory_gib:6.1f} GiB (band {low:.1f}-{high:.1f})")


def predicted_tokens_per_s(entry: PlanEntry) -> float:
    return (entry.predicted.tokens_per_s if entry.predicted else None) or 0.0


def summarise(entries: list[PlanEntry], top: int) -> None:
    valid = [e for e in entries if e.valid]
    launchable = [e for e in valid if e.launchable]
    fits = [e for e in valid if e.predicted is not None and e.predicted.fits]
    print(f"{len(entries)} layouts: {len(valid)} valid, {len(launchable)} launchable "
          f"({len(fits)} predicted to fit, {len(launchable) - len(fits)} inside the estimator's error band), "
          f"{len(entries) - len(valid)} invalid")
    # build_plan lists the layouts predicted to fit first, fastest predicted first; sorting again says so here.
    best = sorted(fits, key=predicted_tokens_per_s, reverse=True)[:top]
    if best:
        print(f"best {len(best)} predicted (predicted to fit, by predicted throughput):")
        for entry in best:
            print("  " + describe(entry))
    for reason, count in invalid_reasons(entries)[:3]:
        print(f"  invalid ({count}): {reason}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("space", nargs="?", default=str(DEFAULT_SPACE),
                        help="search YAML, or the name of one in search_spaces/ (default: nemotron.yaml)")
    parser.add_argument("--only", help='a second plan keeping only the layouts that match, as `plan --only`, e.g. '
                        '"gpus=8,ep=8,sp=true" (default: the smallest world size at the first TP size of the space)')
    parser.add_argument("--top", type=int, default=5, help="how many of the best predicted layouts to print")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(resolve_space_path(args.space))
        text = args.only or f"gpus={min(cfg.world_sizes)},tp={cfg.space.values('tp')[0]}"
        only = only_filter(text)  # the same parser as `plan --only`: an unknown key or a bad value raises
        print(f"{cfg.name}: {cfg.model.name} on {cfg.cluster.nodes} x {cfg.cluster.gpus_per_node} GPUs "
              f"({cfg.cluster.gpu_memory_gib:g} GiB each, stable below {cfg.memory_limit_gib:.1f} GiB)")
        summarise(build_plan(cfg), args.top)

        print(f"\n--only {text!r}:")
        summarise(build_plan(cfg, only), args.top)
    except SweeperError as exc:  # bad YAML or --only: one line, as the command prints it
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
