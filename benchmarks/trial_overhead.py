"""Where the time of one smoke trial goes, and how much of it is overhead around the training steps.

Starts a simulated 2-node x 2-GPU Ray cluster, runs one trial of tiny-gpt (TP2 x PP2 by default, real
megatron-core on gloo, no equivalence reference) through the same TrialHost the sweep uses, and prints the split:
cluster start and stop (the driver's clock; a sweep pays them once), placement (the runner's note), each smoke-run
phase from the ranks' ``timings_s`` (the slowest rank per phase: megatron import, process-group and parallel-group
init, model build, steps, checkpoint save and load), and the remainder of the trial's wall time (rank actors
starting, rendezvous, reports travelling back, killing the actors, removing the group). Overhead is everything but
the steps, as a ratio of the steps' time, per trial and including the cluster.

    python benchmarks/trial_overhead.py [--layout "gpus=4,tp=2,pp=2"] [--steps 6] [--trials 3] [--pool both] [--json]
    python benchmarks/trial_overhead.py --gpu [--trials 3]   # one GPU, 20 steps (not run on a GPU yet)

``--gpu`` measures the same split on this machine's GPUs: a new local Ray instance, a ~0.85B dense model at sequence
4096, one GPU in BF16, 20 steps by default (issue 15's goal there: overhead <= 10% of a 20-step smoke run). The side
by side table also gives the overhead without the checkpoint save and reload, which the smoke-run contract makes
part of every trial whatever sweeper does around it.

``--pool both`` (the default) measures the same trials twice in one run, on warm rank processes
(``cluster.warm_ranks: true``: megatron imported once per GPU, each trial's rank a fresh fork) and on new rank actors
per trial (``false``), and prints the overhead ratios side by side. The first trial on warm ranks pays their
start-up (the cold column); the later ones are what every further trial of a sweep costs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sweeper.config.load import load_config  # noqa: E402
from sweeper.config.schema import layout_from_string  # noqa: E402

SPACE = """\
name: trial-overhead
model: tiny-gpt
cluster: {{nodes: 2, gpus_per_node: 2, gpu_memory_gib: 4, compute_capability: "9.0", simulate: true,
          warm_ranks: {warm}}}
training: {{seq_length: 64, global_batch_size: 8, steps: {steps}, warmup_steps: 2, checkpoint: true,
           trial_timeout_s: 600}}
space: {{gpus: [4], tp: [1, 2], pp: [1, 2], precision: [fp32, bf16]}}
"""
# --gpu: this machine's GPUs as a new local Ray instance, and a model whose 20 steps are a smoke run's worth of GPU
# work: a ~0.85B dense GQA model at sequence 4096, 16 sequences a step (the estimator: 0.9 s a step on one H100/H200,
# 20 GiB), so the steps are not a few milliseconds of launch latency against seconds of checkpointing.
GPU_SPACE = """\
name: trial-overhead-gpu
model: {{name: overhead-dense-0.85b, num_layers: 16, hidden_size: 2048, ffn_hidden_size: 5632,
        num_attention_heads: 16, num_query_groups: 4, vocab_size: 32000, max_position_embeddings: 4096}}
cluster: {{nodes: 1, gpus_per_node: {gpus}, gpu_memory_gib: {memory_gib}, compute_capability: "{capability}",
          address: local, simulate: false, warm_ranks: {warm}}}
training: {{seq_length: 4096, global_batch_size: 16, steps: {steps}, warmup_steps: 2, checkpoint: true,
           trial_timeout_s: 900}}
space: {{gpus: [{world_sizes}], tp: [1, 2], pp: [1, 2], precision: [bf16]}}
"""
CPU_LAYOUT, CPU_STEPS = "gpus=4,tp=2,pp=2,precision=fp32", 6
GPU_LAYOUT, GPU_STEPS = "gpus=1,tp=1,pp=1,precision=bf16", 20
RANK_PHASES = ("import", "init", "build", "equivalence", "steps", "checkpoint_save", "checkpoint_load")
_PLACED = re.compile(r"reserved in ([0-9.]+)s")


def local_gpus() -> dict[str, str]:
    """GPU_SPACE's cluster fields for this machine's GPUs; exits 2 when torch sees none."""
    import torch

    if not torch.cuda.is_available():
        print("trial_overhead --gpu: no CUDA device visible (torch.cuda.is_available() is False)", file=sys.stderr)
        raise SystemExit(2)
    props = torch.cuda.get_device_properties(0)
    count = torch.cuda.device_count()
    return {"gpus": str(count), "world_sizes": ", ".join(str(n) for n in sorted({1, count})),
            "memory_gib": f"{props.total_memory / 2**30:.0f}",
            "capability": f"{props.major}.{props.minor}", "name": props.name}


def space_text(steps: int, warm: bool, gpu: dict[str, str] | None = None) -> str:
    """The space YAML of one run: the simulated CPU cluster, or ``gpu`` (``local_gpus()``) as a local instance."""
    flag = "true" if warm else "false"
    return GPU_SPACE.format(steps=steps, warm=flag, **gpu) if gpu else SPACE.format(steps=steps, warm=flag)


def run(layout_text: str, steps: int, trials: int, warm: bool, gpu: dict[str, str] | None = None) -> dict:
    from sweeper.trial.host import open_host

    work = Path(tempfile.mkdtemp(prefix="sweeper-overhead-"))
    space = work / "space.yaml"
    space.write_text(space_text(steps, warm, gpu))
    cfg = load_config(space)
    layout = layout_from_string(cfg, layout_text)
    where = f"{gpu['name']}, local Ray instance" if gpu else "simulated 2 nodes x 2 GPUs"
    out: dict = {"layout": layout.short(), "steps": steps, "warm_ranks": warm, "where": where,
                 "model": cfg.model.name, "trials": []}

    start = time.perf_counter()
    host_cm = open_host(cfg)
    host = host_cm.__enter__()
    out["cluster_start_s"] = time.perf_counter() - start
    try:
        for i in range(trials):
            slot = None
            deadline = time.monotonic() + 60
            while slot is None and time.monotonic() < deadline:
                slot = host.reserve(layout)  # a fresh cluster's nodes may still be registering
                if slot is None:
                    time.sleep(0.5)
            if slot is None:
                raise SystemExit(f"no free nodes for {layout.short()}")
            start = time.perf_counter()
            try:
                result = host.run_trial(cfg, layout, work / f"trial-{i}", reservation=slot)
            finally:
                host.release(slot)
            wall = time.perf_counter() - start
            if not result.passed:
                raise SystemExit(f"trial {i} failed ({result.failure_kind}): {result.error}")
            placed = next((float(m.group(1)) for n in result.notes if (m := _PLACED.search(n))), 0.0)
            phases = {k: result.timings_s[k] for k in RANK_PHASES if k in result.timings_s}
            out["trials"].append({
                "wall_s": wall,
                "placement_s": placed,
                "phases_s": phases,
                "actors_and_teardown_s": max(wall - placed - sum(phases.values()), 0.0),
                "step_time_s": result.metrics.step_time_s,
            })
    finally:
        start = time.perf_counter()
        host_cm.__exit__(None, None, None)
        out["cluster_stop_s"] = time.perf_counter() - start
        shutil.rmtree(work, ignore_errors=True)  # its checkpoints: on --gpu, ~1.7 GB of weights a trial
    return out


def report(data: dict) -> None:
    mode = "warm rank processes" if data["warm_ranks"] else "new rank actors per trial"
    print(f"one trial of {data['model']} {data['layout']}, {data['steps']} steps, {data['where']}, {mode}")
    print(f"  {'cluster start':<34} {data['cluster_start_s']:7.2f} s   (once per sweep)")
    for i, t in enumerate(data["trials"]):
        steps = t["phases_s"].get("steps", 0.0)
        print(f"  trial {i} ({'cold' if i == 0 else 'warm cluster'}): {t['wall_s']:.2f} s wall")
        rows = [("placement", t["placement_s"]), ("actor start, rendezvous, teardown", t["actors_and_teardown_s"])]
        rows += [(f"rank: {k.replace('_', ' ')}", v) for k, v in t["phases_s"].items()]
        for name, value in rows:
            print(f"    {name:<32} {value:7.2f} s  {100 * value / t['wall_s']:5.1f} %")
        overhead = t["wall_s"] - steps
        print(f"    {'median step':<32} {t['step_time_s']:7.3f} s")
        print(f"    overhead (all but steps)         {overhead:7.2f} s = {overhead / steps:.2f} x the steps' time")
    print(f"  {'cluster stop':<34} {data['cluster_stop_s']:7.2f} s")


def ratio(trial: dict, checkpoint: bool = True) -> float:
    """Overhead over the steps' time; ``checkpoint=False`` leaves the checkpoint save and reload out of it."""
    phases = trial["phases_s"]
    steps = phases.get("steps", 0.0)
    kept = trial["wall_s"] - steps
    if not checkpoint:
        kept -= phases.get("checkpoint_save", 0.0) + phases.get("checkpoint_load", 0.0)
    return kept / steps if steps else float("nan")


def side_by_side(runs: list[dict]) -> None:
    print("\noverhead / steps' time, same layout and steps, measured in this run:")
    print(f"  {'rank processes':<28} {'first trial':>12} {'later trials (median)':>22} {'later, checkpoint apart':>24}")
    for data in runs:
        ratios = [ratio(t) for t in data["trials"]]
        later = statistics.median(ratios[1:]) if len(ratios) > 1 else float("nan")
        apart = statistics.median(ratio(t, checkpoint=False) for t in data["trials"][1:]) if len(ratios) > 1 \
            else float("nan")
        name = "warm (warm_ranks: true)" if data["warm_ranks"] else "new (warm_ranks: false)"
        print(f"  {name:<28} {ratios[0]:>11.2f}x {later:>21.2f}x {apart:>23.2f}x")
    if len(runs) == 2 and all(len(d["trials"]) > 1 for d in runs):
        warm, new = (statistics.median(ratio(t) for t in d["trials"][1:]) for d in runs)
        print(f"  warm / new overhead: {warm / new:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", help=f'default "{CPU_LAYOUT}"; with --gpu "{GPU_LAYOUT}"')
    parser.add_argument("--steps", type=int, help=f"default {CPU_STEPS}; with --gpu {GPU_STEPS} (issue 15's smoke run)")
    parser.add_argument("--gpu", action="store_true",
                        help="this machine's GPUs (a local Ray instance, a ~0.85B dense model at sequence 4096) "
                             "instead of the simulated CPU cluster; exits 2 when no GPU is visible")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--pool", choices=("both", "on", "off"), default="both",
                        help="warm rank processes (on), new rank actors per trial (off), or both side by side")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    args = parser.parse_args()
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.pool]
    gpu = local_gpus() if args.gpu else None
    layout = args.layout or (GPU_LAYOUT if gpu else CPU_LAYOUT)
    steps = args.steps or (GPU_STEPS if gpu else CPU_STEPS)
    runs = [run(layout, steps, args.trials, warm, gpu) for warm in modes]
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    for data in runs:
        report(data)
    side_by_side(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
