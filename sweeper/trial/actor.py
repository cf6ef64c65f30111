"""RankActor: the Ray actor that hosts one torch.distributed rank of a trial.

One actor per GPU, scheduled into its placement-group bundle by the runner. It first describes where it landed
(node, IP, the GPU ids Ray gave it, and for rank 0 a free port for the rendezvous), then runs the backend's
``run_rank`` in its own process with the rendezvous environment set. It never restarts (``max_restarts=0``): a
rank that dies is a failed attempt for the runner to report, not something to paper over.

The backend is named as ``"module:function"`` so tests can substitute their own; the driver's ``sys.path`` is
appended to the worker's so modules importable in the driver (tests, a checkout that is not installed) import
in the rank too.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ray

from sweeper.backends.base import RankReport, SmokeRequest, shared_checks
from sweeper.record.schema import TrialChecks
from sweeper.trial import stacks
from sweeper.trial.aggregate import classify_exception


@dataclass(frozen=True)
class RankSlot:
    """Where a rank actor landed."""

    rank: int
    node_id: str
    ip: str
    gpu_ids: tuple[str, ...]  # Ray's GPU ids for this actor (physical ids on GPU nodes, virtual on simulated ones)
    pid: int
    port: int | None  # a free TCP port on this node, asked of rank 0 only


# A simulated cluster's ranks run on the CPU whatever torch build is installed: Ray's virtual GPU ids are not
# devices, and a CUDA build of torch on a machine without a driver must never be asked for one. With no visible
# device torch's NVML-based check answers "no GPU" without loading NVML or initialising CUDA.
CPU_RANK_ENV = {"CUDA_VISIBLE_DEVICES": "", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


# Two threads: ``run`` holds one for the whole smoke run; ``checks`` answers on the other while it runs.
@ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=2)  # type: ignore[call-overload]  # Ray's stubs lack max_concurrency
class RankActor:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def describe(self, want_port: bool) -> RankSlot:
        return describe_slot(self.rank, want_port)

    def run(self, backend: str, request: SmokeRequest, env: dict[str, str], driver_sys_path: list[str]) -> RankReport:
        os.environ.update(env)
        extend_sys_path(driver_sys_path)
        return call_backend(self.rank, backend, request, env.get("SWEEPER_NODE_ID", ""))

    def checks(self) -> TrialChecks:
        """What the rank running in this process has proven so far (read by the runner before it stops a rank
        that has not reported)."""
        return shared_checks()


def describe_slot(rank: int, want_port: bool) -> RankSlot:
    """Where the calling actor runs (``rank`` -1: a warm rank, whose rank the runner assigns per trial)."""
    ip = ray.util.get_node_ip_address()
    return RankSlot(
        rank=rank,
        node_id=ray.get_runtime_context().get_node_id(),
        ip=ip,
        gpu_ids=tuple(str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])),
        pid=os.getpid(),
        port=_free_port(ip) if want_port else None,
    )


def call_backend(rank: int, backend: str, request: SmokeRequest, node: str) -> RankReport:
    """Run the backend for one rank in this process; a backend that raises or returns something else is reported,
    never propagated."""
    try:
        fn = load_backend(backend)
        with stacks.armed(request.trial_dir, rank, request.stack_dump_at):  # hang forensics (trial/stacks.py)
            report = fn(request)
    except BaseException as exc:  # noqa: BLE001 - a backend must not raise; if it does, report, don't crash
        _write_traceback(request.trial_dir, rank)
        return RankReport(
            rank=rank,
            node_id=node,
            backend="unknown",
            ok=False,
            failure_kind=classify_exception(exc),
            error=f"backend raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}".rstrip(": "),
        )
    if not isinstance(report, RankReport):
        return RankReport(rank=rank, node_id=node, backend="unknown", ok=False, failure_kind="infra",
                          error=f"backend {backend} returned {type(report).__name__}, not a RankReport")
    if not report.node_id:
        report.node_id = node
    return report


def extend_sys_path(entries: list[str]) -> None:
    """The driver's import path, appended (modules importable in the driver import in the rank too)."""
    for entry in entries:
        if entry not in sys.path and os.path.isdir(entry):
            sys.path.append(entry)


def load_backend(spec: str) -> Callable[[SmokeRequest], RankReport]:
    """Resolve ``"package.module:function"``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"backend must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module_name), attr)


def _free_port(ip: str) -> int:
    # The port is released before torch binds it; another process could take it in between, which is rare on a
    # node whose GPUs this trial has reserved, and fails the trial as comm_error rather than hanging.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])


def _write_traceback(trial_dir: str, rank: int) -> None:
    try:
        path = Path(trial_dir) / f"rank{rank}.runner-error.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(traceback.format_exc())
    except OSError:
        pass
