"""Where a multi-rank proxy trial spends its time on the CPU, by part, and what the proxy run's shrink saves (issue 31).

Runs the smoke run of one layout of a flagship proxy in W real gloo processes (no Ray; each rank a spawned process
like a fresh rank actor), each under cProfile, twice: the layout as written, and as a proxy trial runs it
(``trial.proxy_run``: the fewest data-parallel replicas and micro-batches that keep every group). No reference,
no checkpoint: the steps only. Prints each run's wall time, the smoke run's phase times (slowest rank) and the
steps' time by part (the mean over ranks of cProfile's cumulative wall time, so waiting in a collective counts
as gloo). The ratio is measured in this run.

    python benchmarks/proxy_ranks.py [--space deepseek_v2_lite] [--layout tp=1,pp=4,ep=4,gpus=16] [--steps 2]
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import os
import pstats
import socket
import tempfile
import time
from pathlib import Path

from proxy_step import _parts  # the same cProfile summing (benchmarks/ is this script's folder on sys.path)

_PARTS = (
    ("experts (forward)", ("moe/experts.py", "cpu/experts.py"), "forward"),
    ("router (forward)", ("moe/router.py",), "forward"),
    ("token dispatch / combine", ("moe/token_dispatcher.py",), ("token_dispatch", "token_combine",
                                                                "dispatch_preprocess", "combine_postprocess")),
    ("Mamba mixer (forward)", ("cpu/mamba.py", "ssm/mamba_mixer.py"), "forward"),
    ("attention (forward)", ("cpu/attention.py", "dot_product_attention.py", "multi_latent_attention.py",
                             "transformer/attention.py"), "forward"),
    ("backward (all)", ("~",), "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
    ("pipeline send/recv", ("p2p_communication.py",), ("send_forward", "recv_forward", "send_backward",
                                                       "recv_backward", "send_forward_recv_backward",
                                                       "send_backward_recv_forward")),
    ("gloo collectives (all)", ("distributed_c10d.py",), ("all_reduce", "all_to_all_single", "all_gather",
                                                          "all_gather_into_tensor", "reduce_scatter_tensor",
                                                          "broadcast", "barrier", "batch_isend_irecv",
                                                          "_all_gather_base", "_reduce_scatter_base")),
    ("optimizer step", ("optimizer/optimizer.py", "optimizer/distrib_optimizer.py"), "step"),
    ("steps (whole)", ("steps.py",), "train_step"),
)


def _rank(rank: int, world: int, port: int, request: object, folder: str, out: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    import torch

    torch.set_num_threads(1)
    from sweeper.backends.megatron import run_rank

    profile = cProfile.Profile()
    profile.enable()
    report = run_rank(request)  # type: ignore[arg-type]
    profile.disable()
    profile.dump_stats(f"{folder}/rank_{rank}.prof")
    out.put((rank, report.ok, report.error, report.timings_s))  # type: ignore[attr-defined]


def _run(request: object, world: int, folder: str) -> tuple[float, dict[str, float], dict[str, float]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter()
    procs = [ctx.Process(target=_rank, args=(r, world, port, request, folder, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join()
    wall = time.perf_counter() - start
    for rank, ok, error, _ in results:
        if not ok:
            raise SystemExit(f"rank {rank} failed: {error}")
    phases: dict[str, float] = {}
    for _, _, _, timings in results:
        for key, value in timings.items():
            phases[key] = max(phases.get(key, 0.0), value)
    parts = {name: 0.0 for name, _, _ in _PARTS}
    for rank in range(world):
        for name, value in _parts(pstats.Stats(f"{folder}/rank_{rank}.prof"), _PARTS).items():
            parts[name] += value / world
    return wall, phases, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--space", default="deepseek_v2_lite")
    parser.add_argument("--layout", default="tp=1,pp=4,ep=4,gpus=16,mbs=1,recompute=none,precision=bf16")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    from sweeper.backends.base import SmokeRequest
    from sweeper.config.load import load_config, proxy_config, resolve_space_path
    from sweeper.config.schema import layout_from_string
    from sweeper.trial.proxy_run import proxy_run_layout

    cfg = proxy_config(load_config(resolve_space_path(args.space)))
    layout = layout_from_string(cfg, args.layout)
    runs = {"as written": layout, "proxy run": proxy_run_layout(layout)}
    print(f"{cfg.model.name}, seq {cfg.training.seq_length}, {args.steps} steps (1 warm-up), no gate or checkpoint")
    measured = {}
    for label, run in runs.items():
        with tempfile.TemporaryDirectory() as folder:
            request = SmokeRequest(model=cfg.model, layout=run, seq_length=cfg.training.seq_length, steps=args.steps,
                                   warmup_steps=1, checkpoint=False, checkpoint_every=None,
                                   trial_dir=str(Path(folder) / "trial"), timeout_s=1800.0)
            wall, phases, parts = _run(request, run.world_size, folder)
        measured[label] = wall
        print(f"\n{label}: {run.short()} ({run.world_size} ranks, {run.num_microbatches} micro-batches per rank "
              f"and step): {wall:.1f} s wall, processes started to last report")
        print("  phases (slowest rank): " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
        whole = parts["steps (whole)"] or 1.0
        print("  the steps by part (mean over ranks, cumulative wall time under cProfile):")
        for name, seconds in parts.items():
            print(f"    {name:28s} {seconds:7.2f} s {100 * seconds / whole:5.1f}%")
    if runs["proxy run"] != layout:
        print(f"\nratio (as written / proxy run): {measured['as written'] / measured['proxy run']:.2f}x")


if __name__ == "__main__":
    main()
