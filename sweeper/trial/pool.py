"""Warm rank processes that outlive a trial (``cluster.warm_ranks``, on by default on a simulated cluster).

Without the pool every trial starts one Ray actor per rank, and each imports torch and megatron-core (most of a CPU
trial's overhead). With it, a ``WarmRank`` actor per GPU is kept for the whole sweep: it imports the backend once
(``warm_up`` of the backend's module) and runs each trial's rank in a child forked from itself
(``trial.forked``), so a trial starts in milliseconds and still runs in a fresh process of its own.

Each warm rank holds one GPU in a one-bundle placement group pinned to its node, created the first time the sweep's
ledger (``trial.host``) sends a trial there; the ledger never gives a node more trial ranks than it has GPUs, so the
pool never holds more. A trial leases the warm ranks of its reservation's nodes in bundle order (rank r on the
node of bundle ``r // gpus_per_bundle``, as with a per-trial placement group) and gives them back when it ends.
A warm rank whose actor died, did not stop its child when told, or sat on a lost node is retired (actor killed,
group removed) and replaced by a new one on the next lease.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sweeper.backends.base import RankReport, SmokeRequest, shared_checks
from sweeper.cluster.placement import PlacementTimeout
from sweeper.record.schema import TrialChecks
from sweeper.trial.actor import CPU_RANK_ENV, RankSlot, call_backend, describe_slot, extend_sys_path
from sweeper.trial.forked import ForkedRank, RankDied

CHECKS_ANSWER_S = 2.0  # how long a running child gets to answer; then what it last said unasked is its answer
STOP_CONFIRM_S = 10.0  # how long a warm rank gets to confirm its child is gone before the actor is retired


@ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=2)  # type: ignore[call-overload]  # Ray's stubs lack max_concurrency
class WarmRank:
    """One GPU's rank process for the sweep: warm imports, a forked child per trial (``run``), ``checks`` and
    ``stop`` answered on the second thread while a child runs."""

    def __init__(self, backend: str, driver_sys_path: list[str], gpu: bool) -> None:
        """``gpu``: False on a simulated cluster, whose ranks are CPU ranks (``CPU_RANK_ENV``), set before the
        backend imports torch, and inherited by every forked child."""
        if not gpu:
            os.environ.update(CPU_RANK_ENV)
        extend_sys_path(driver_sys_path)
        self._child: ForkedRank | None = None
        self._reported = TrialChecks()  # the last ended child's checks (nothing proven before its first trial)
        self._lock = threading.Lock()
        module = importlib.import_module(backend.partition(":")[0])
        warm_up = getattr(module, "warm_up", None)
        if callable(warm_up):
            warm_up(gpu=gpu)

    def describe(self, want_port: bool) -> RankSlot:
        return describe_slot(-1, want_port)

    def run(self, backend: str, request: SmokeRequest, env: dict[str, str],
            driver_sys_path: list[str]) -> RankReport | RankDied:
        rank = int(env["RANK"])
        child_env = {**os.environ, **env}

        def in_child() -> RankReport:
            extend_sys_path(driver_sys_path)
            return call_backend(rank, backend, request, env.get("SWEEPER_NODE_ID", ""))

        with self._lock:
            self._child = ForkedRank(in_child, shared_checks, child_env)
            self._reported = TrialChecks()
        report: RankReport | RankDied | None = None
        try:
            report = self._child.wait()
            return report
        finally:
            with self._lock:
                said = self._child.said
                self._child = None
                self._reported = report.checks if isinstance(report, RankReport) else said

    def checks(self) -> TrialChecks:
        """What this trial's rank has proven: asked of the running child, or, once it has ended, its report's
        (the runner may ask after the report was sent but before it read it: the first failing peer stops it)."""
        with self._lock:
            child, reported = self._child, self._reported
        if child is None:
            return reported
        proven = child.checks(CHECKS_ANSWER_S)
        with self._lock:  # the child may have ended while asked: then its report's are the whole story
            return self._reported if self._child is None else proven

    def stop(self) -> bool:
        """Kill the running child, if any (its ``run`` then returns RankDied); True once none runs."""
        with self._lock:
            child = self._child
        if child is not None:
            child.kill()
        deadline = time.monotonic() + STOP_CONFIRM_S / 2
        while time.monotonic() < deadline:
            with self._lock:
                if self._child is None:
                    return True
            time.sleep(0.05)
        return False


@dataclass
class Warm:
    """A warm rank as the driver knows it."""

    actor: Any  # ray.actor.ActorHandle of WarmRank
    group: PlacementGroup
    node_id: str


@dataclass
class Lease:
    """The warm ranks of one trial, in rank order."""

    ranks: list[Warm]
    fresh: int  # how many were started for this trial (the rest were reused)
    wait_s: float

    @property
    def actors(self) -> list[Any]:
        return [w.actor for w in self.ranks]


class RankPool:
    """The sweep's warm ranks per node. The driver's threads call in here (one lock)."""

    def __init__(self, backend: str, cpus_per_rank: float, gpu: bool) -> None:
        """``gpu``: the warm ranks use the GPUs Ray gives them; False on a simulated cluster (CPU ranks)."""
        self.backend = backend
        self.cpus_per_rank = cpus_per_rank
        self.gpu = gpu
        self._idle: dict[str, list[Warm]] = {}
        self._busy: list[Warm] = []
        self._lock = threading.Lock()
        self._closed = False

    def held_per_node(self) -> dict[str, int]:
        """The GPUs this pool's warm ranks hold in Ray, idle or leased, per node id."""
        with self._lock:
            held: dict[str, int] = {}
            for warm in self._busy + [w for ranks in self._idle.values() for w in ranks]:
                held[warm.node_id] = held.get(warm.node_id, 0) + 1
            return held

    def lease(self, node_ids: list[str], per_bundle: int, world_size: int, timeout_s: float) -> Lease:
        """Warm ranks for a trial whose bundle i of ``per_bundle`` GPUs is on ``node_ids[i]`` (idle ones first, new
        ones for the rest). Raises PlacementTimeout when a new one's GPU is not reserved within ``timeout_s``."""
        started = time.monotonic()
        wanted = rank_nodes(node_ids, per_bundle, world_size)
        ranks: list[Warm | None] = [None] * world_size
        with self._lock:
            if self._closed:
                raise PlacementTimeout("the rank pool is closed")
            for rank, node in enumerate(wanted):
                idle = self._idle.get(node, [])
                if idle:
                    ranks[rank] = idle.pop()
        new = [rank for rank, warm in enumerate(ranks) if warm is None]
        groups: dict[int, PlacementGroup] = {}
        try:
            for rank in new:
                groups[rank] = self._reserve(wanted[rank])
            deadline = time.monotonic() + timeout_s
            for rank, group in groups.items():
                ready, _ = ray.wait([group.ready()], timeout=max(deadline - time.monotonic(), 0.001))
                if not ready:
                    raise PlacementTimeout(f"placement: a warm rank's GPU on node {wanted[rank][:8]} was not "
                                           f"reserved within {timeout_s:.0f}s")
                ranks[rank] = Warm(self._start(group), group, wanted[rank])
        except BaseException:
            for rank, group in groups.items():
                if ranks[rank] is None:
                    remove_placement_group(group)
            started_now = [w for rank, w in enumerate(ranks) if w is not None and rank in groups]
            self.give_back([w for w in ranks if w is not None], retire=started_now)
            raise
        leased = [w for w in ranks if w is not None]
        with self._lock:
            self._busy.extend(leased)
        return Lease(leased, fresh=len(new), wait_s=time.monotonic() - started)

    def prestart(self, node_ids: list[str]) -> int:
        """Start a warm rank on each of ``node_ids`` (a node named as often as it gets ranks) beside what is idle
        there already, without waiting for them: their imports run while the sweep makes its reference, and the
        first trial leases them (a call on a rank still importing waits for it). Returns how many were started."""
        with self._lock:
            idle_left = {node: len(ranks) for node, ranks in self._idle.items()}
        started = 0
        for node in node_ids:
            if idle_left.get(node, 0) > 0:
                idle_left[node] -= 1
                continue
            group = self._reserve(node)
            warm = Warm(self._start(group), group, node)
            with self._lock:
                if self._closed:
                    _retire(warm)
                    break
                self._idle.setdefault(node, []).append(warm)
            started += 1
        return started

    def give_back(self, ranks: list[Warm], retire: list[Warm]) -> None:
        """A trial's warm ranks back to the pool when it ended; those in ``retire`` are killed instead."""
        retired = {id(w) for w in retire}
        with self._lock:
            for warm in ranks:
                if warm in self._busy:
                    self._busy.remove(warm)
                if id(warm) in retired or self._closed:
                    _retire(warm)
                else:
                    self._idle.setdefault(warm.node_id, []).append(warm)

    def keep_nodes(self, alive: set[str]) -> None:
        """Retire the idle warm ranks of nodes no longer alive (they died with their node)."""
        with self._lock:
            for node in [n for n in self._idle if n not in alive]:
                for warm in self._idle.pop(node):
                    _retire(warm)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for warm in [w for idle in self._idle.values() for w in idle] + self._busy:
                _retire(warm)
            self._idle.clear()
            self._busy.clear()

    def _reserve(self, node_id: str) -> PlacementGroup:
        return placement_group([{"GPU": 1.0, "CPU": self.cpus_per_rank}], strategy="STRICT_PACK",
                               name=f"sweeper-warm-{os.urandom(3).hex()}",
                               bundle_label_selector=[{NODE_ID_LABEL_KEY: node_id}])

    def _start(self, group: PlacementGroup) -> Any:
        return WarmRank.options(  # type: ignore[attr-defined]  # added by @ray.remote
            num_gpus=1,
            num_cpus=self.cpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                 placement_group_bundle_index=0),
            name=f"sweeper-warm-{group.id.hex()[:12]}",
        ).remote(self.backend, [os.getcwd()] + [p for p in sys.path if p], self.gpu)


def rank_nodes(node_ids: list[str], per_bundle: int, world_size: int) -> list[str]:
    """The node of each rank: rank r on that of bundle ``r // per_bundle``, as a per-trial placement group puts it."""
    return [node_ids[rank // per_bundle] for rank in range(world_size)]


def _retire(warm: Warm) -> None:
    try:
        ray.kill(warm.actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead (its node was lost): the group removal still follows
        pass
    try:
        remove_placement_group(warm.group)
    except Exception:  # noqa: BLE001 - a group on a lost node may already be gone
        pass
