"""Test helper: run the megatron backend's ``run_rank`` in W real processes without Ray.

Each rank is a fresh process with the torch.distributed rendezvous environment set, as the Ray runner sets it;
reports come back through a queue. Ranks start from a ``forkserver`` that has imported torch and megatron once
(importing them costs ~9 s of CPU per process, which dominated these tests on two cores); every rank still
initialises its own process group, CPU compatibility layer and model after the fork. A rank that dies or never answers within the timeout is reported as
None (and killed), so a test can assert on crashes and hangs without hanging itself.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
from typing import Any

from sweeper.backends.base import RankReport, SmokeRequest
from sweeper.models.catalog import preset
from sweeper.trial.runner import loopback_interface


def smoke_request(trial_dir: Any, layout: Any, model: str, seq_length: int, **kw: object) -> SmokeRequest:
    """A one-step request without checkpoints on a catalog model, seed 1234; ``kw`` overrides any field."""
    base: dict = dict(
        model=preset(model), layout=layout, seq_length=seq_length, steps=1, warmup_steps=0,
        checkpoint=False, checkpoint_every=None, trial_dir=str(trial_dir), seed=1234, timeout_s=90.0,
    )
    base.update(kw)
    return SmokeRequest(**base)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, request: SmokeRequest, out: Any, loopback: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        GLOO_SOCKET_IFNAME=loopback,  # gloo's pairs on loopback too, as the runner tells a simulated cluster's ranks
        # Two CPU cores shared by up to four ranks: one intra-op thread each avoids oversubscription.
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    from sweeper.backends.megatron import run_rank

    out.put(run_rank(request))


_PRELOAD = [
    "torch",
    "megatron.core",
    "sweeper.backends.megatron.build",
    "sweeper.backends.megatron.steps",
    "sweeper.backends.megatron.checkpoint",
]


def _context() -> Any:
    # SWEEPER_TEST_START_METHOD=spawn starts every rank from scratch, exactly like a fresh Ray actor process.
    if os.environ.get("SWEEPER_TEST_START_METHOD") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(request: SmokeRequest, world: int, timeout_s: float = 240.0) -> list[RankReport | None]:
    """Run ``world`` ranks of ``request``; the i-th entry is rank i's report, None if it died or hung."""
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, request, out, loopback_interface()),
                         daemon=False) for r in range(world)]
    for proc in procs:
        proc.start()
    reports: dict[int, RankReport] = {}
    deadline = time.monotonic() + timeout_s
    while len(reports) < world and time.monotonic() < deadline:
        try:
            report = out.get(timeout=0.5)
            reports[report.rank] = report
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and out.empty():
                break
    for proc in procs:
        proc.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        if proc.is_alive():
            proc.kill()
            proc.join()
    return [reports.get(r) for r in range(world)]
