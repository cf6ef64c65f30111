"""Measure the equivalence gate's error of known-correct layouts per precision, and of a wrong one (issue 44).

The gate's tolerance must sit above what correct layouts measure and below what a wrong layout measures. For each
model (tiny-gpt, tiny-moe and the two flagship proxies) this makes one-rank references in FP32 and in BF16 on a
simulated 1 x 2 cluster, then runs every axis that the CPU backend runs alone at two ranks (TP2+SP, PP2, EP2, CP2,
DP2) as a real trial in FP32 against the FP32 reference, and in BF16 against both references, and the injected
wrong layout (``swap_shards``: each TP rank's fc1 shard swapped) in BF16 against both. Each trial's gate error
(``checks.equivalence_rel_err``) goes into one JSON table with the machine, the versions and the command.

    python scripts/measure_gate_error.py --out tests/data/gate_error.json            # ~30 min on 2 cores
    python scripts/measure_gate_error.py --models tiny-gpt --out /tmp/gate.json     # one model
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

from sweeper.backends.megatron.support import unsupported_reason  # noqa: E402
from sweeper.config.load import load_config, proxy_config  # noqa: E402
from sweeper.config.schema import SweepConfig, layout_from_string  # noqa: E402
from sweeper.plan.rules import check  # noqa: E402

SPACES = {"tiny-gpt": "search_spaces/quickstart.yaml", "tiny-moe": "search_spaces/quickstart.yaml",
          "nemotron": "search_spaces/nemotron.yaml", "deepseek": "search_spaces/deepseek_v2_lite.yaml"}
AXES = ["tp=2,sp=true", "tp=2,ep=2,sp=true", "pp=2", "ep=2", "cp=2", "dp=2"]
WRONG = "tp=2,sp=true"  # swap_shards needs TP (or swaps the halves of one rank's shard)


def config(which: str) -> SweepConfig:
    """The model on one simulated node of 2 GPUs; 32 tokens, 4 sequences, one step, no checkpoint."""
    cfg = load_config(ROOT / SPACES[which])
    if which in ("nemotron", "deepseek"):
        cfg = proxy_config(cfg)
    elif which != cfg.model.name:
        from sweeper.models.catalog import preset

        cfg = cfg.model_copy(update=dict(model=preset(which)))
    cluster = cfg.cluster.model_copy(update=dict(nodes=1, gpus_per_node=2, simulate=True, warm_ranks=True))
    training = cfg.training.model_copy(update=dict(seq_length=32, global_batch_size=4, steps=1, warmup_steps=0,
                                                   checkpoint=False, checkpoint_every=None, trial_timeout_s=900))
    return cfg.model_copy(update=dict(name=f"gate-{which}", cluster=cluster, training=training))


def runnable(cfg: SweepConfig, axes: str, precision: str) -> str | None:
    """The layout text when the rules and the CPU backend take it, else None."""
    text = "gpus=2" + ("" if axes == "dp=2" else f",{axes}") + f",precision={precision}"
    layout = layout_from_string(cfg, text)
    if check(cfg.model, layout, cfg.cluster, cfg.training.seq_length):
        return None
    return text if unsupported_reason(cfg.model, layout, cuda=False, te=False) is None else None


def measure(which: str, work: Path) -> list[dict]:
    from sweeper.trial.host import open_host
    from sweeper.trial.protocol import reserved
    from sweeper.trial.reference import ensure_reference

    cfg = config(which)
    rows: list[dict] = []
    with open_host(cfg) as host:
        refs = {}
        for precision in ("fp32", "bf16"):
            ref = ensure_reference(cfg, host, work / which / f"reference-{precision}", precision)
            if not ref.path:
                sys.exit(f"{which}: the {precision} reference failed: {ref.note}")
            refs[precision] = ref.path
        runs = [(axes, "fp32", "fp32", None) for axes in AXES]
        runs += [(axes, "bf16", ref, None) for axes in AXES for ref in ("fp32", "bf16")]
        runs += [(WRONG, precision, ref, "swap_shards") for precision, ref in
                 (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"))]
        for axes, precision, ref, inject in runs:
            text = runnable(cfg, axes, precision)
            if text is None:
                continue
            layout = layout_from_string(cfg, text)
            started = time.monotonic()
            with reserved(host, layout, 60) as slot:
                assert slot is not None
                name = f"{text}-ref{ref}-{inject}".replace(",", "_").replace("=", "")
                result = host.run_trial(cfg, layout, work / which / name, reservation=slot, reference=refs[ref],
                                        inject=inject)
            row = dict(model=which, layout=layout.short(), axes=axes, precision=precision, reference=ref,
                       inject=inject, status=result.status, failure_kind=result.failure_kind,
                       rel_err=result.checks.equivalence_rel_err, seconds=round(time.monotonic() - started, 1))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SPACES), choices=list(SPACES))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="sweeper-gate-") as work:
        for which in args.models:
            rows += measure(which, Path(work))
    table = dict(
        command="python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        when=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), python=platform.python_version(), torch=version("torch"),
                     megatron_core=version("megatron-core")),
        rows=rows,
    )
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
