"""Measure every launchable layout of one space on this machine's simulated cluster, several times: a real
throughput landscape for ``benchmarks/search_efficiency.py`` (issue 15).

Each layout the rules accept, the estimator lets through and the CPU backend can run is launched ``--repeats``
times as a real smoke trial (megatron-core on gloo, warm rank processes, no equivalence reference: the gate does
not change the step time), one trial at a time so trials do not share the cores. Repeats go round-robin over the
layouts, so a drift of the machine spreads over all of them instead of biasing a few. The table records each
trial's outcome (tokens/s, step time, peak memory or the failure kind), the machine, the versions and the command.

    python scripts/measure_landscape.py search_spaces/quickstart.yaml --repeats 3 \
        --out tests/data/landscape_quickstart.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sweeper.config.files import write_atomic  # noqa: E402
from sweeper.config.load import load_config  # noqa: E402
from sweeper.plan.assess import assess_all  # noqa: E402
from sweeper.plan.space import enumerate_layouts  # noqa: E402
from sweeper.trial.host import open_host  # noqa: E402
from sweeper.trial.protocol import reserved  # noqa: E402

# CPU features that decide how fast a CPU rank's GEMMs run per precision (on the EPYC without AVX512-BF16 or AMX
# that measured the first two tables, a BF16 matmul ran 17-70x slower than FP32): the table says which kind of host
# its figures come from.
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> dict:
    first: dict[str, str] = {}  # the first processor's block of /proc/cpuinfo
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip() and first:
                break
            key, _, value = line.partition(":")
            first.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(first.get("flags", "").split())
    return {"cpu": first.get("model name") or platform.processor() or platform.machine(),
            "cpu_family": first.get("cpu family"), "cpu_model": first.get("model"),
            "matmul_flags": [f for f in MATMUL_FLAGS if f in flags], "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": version("torch"),
            "megatron-core": version("megatron-core"), "ray": version("ray")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("space", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    cfg = load_config(args.space)
    started = time.monotonic()
    table: dict = {
        "space": str(args.space), "model": cfg.model.name, "training": cfg.training.model_dump(mode="json"),
        "cluster": cfg.cluster.model_dump(mode="json"), "machine": machine(),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "layouts": {},
    }
    work = Path(tempfile.mkdtemp(prefix="sweeper-landscape-"))
    with open_host(cfg) as host:
        layouts = [e.layout for e in assess_all(cfg, enumerate_layouts(cfg))
                   if e.launchable and host.unsupported(cfg.model, e.layout) is None]
        print(f"{len(layouts)} launchable layouts x {args.repeats} repeats", flush=True)
        for layout in layouts:
            table["layouts"][layout.short()] = {"layout": layout.to_dict(), "trials": []}
        for repeat in range(args.repeats):
            for i, layout in enumerate(layouts):
                with reserved(host, layout, 120) as slot:
                    if slot is None:
                        raise SystemExit(f"no free GPUs for {layout.short()}")
                    result = host.run_trial(cfg, layout, work / f"{i}-{repeat}", reservation=slot)
                m = result.metrics
                trial = {"status": result.status, "failure_kind": result.failure_kind,
                         "tokens_per_s": m.tokens_per_s, "step_time_s": m.step_time_s,
                         "peak_memory_gib": m.peak_memory_gib}
                table["layouts"][layout.short()]["trials"].append(trial)
                print(f"[{repeat + 1}/{args.repeats}] {layout.short():<40} {result.status:<7} "
                      f"{result.failure_kind or f'{m.tokens_per_s or 0:,.0f} tokens/s'}", flush=True)
                write_atomic(args.out, json.dumps(table, indent=1) + "\n")  # a stopped run keeps what it measured
    table["wall_s"] = round(time.monotonic() - started, 1)
    spreads = []
    for entry in table["layouts"].values():
        values = [t["tokens_per_s"] for t in entry["trials"] if t["status"] == "passed" and t["tokens_per_s"]]
        if len(values) > 1:
            spreads.append(statistics.pstdev(values) / statistics.mean(values))
    table["noise_cv_median"] = statistics.median(spreads) if spreads else None
    write_atomic(args.out, json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out}: {len(layouts)} layouts in {table['wall_s']:.0f} s; median coefficient of variation "
          f"of tokens/s over repeats: {table['noise_cv_median']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
