"""The sweep's scheduler: the trials in flight, the ones waiting for GPUs, and the host's GPU ledger under them.

Two queues wait: ``retry`` (infra retries and a proposal held until its GPUs free up, so a large trial is not
starved by small ones) is launched first; ``deferred`` holds layouts needing more GPUs than are alive (nodes were
lost) until capacity comes back. While the head of ``retry`` waits, smaller trials may start on the free GPUs for
one typical trial's time (``may_backfill``): the free GPUs work, and the head starts at most about one trial
later. A launched trial holds its reservation until ``wait_one`` sees it end and releases it; the GPU-seconds
it held are counted for the budget. The driver thread alone calls in here.
"""

from __future__ import annotations

import concurrent.futures as cf
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sweeper.record.schema import Phase, TrialResult
from sweeper.search.run.capacity import CapacityWait
from sweeper.space.layout import Layout
from sweeper.trial.protocol import Host, Reservation

HOLD = "hold"  # take_retry: the head of the queue waits for GPUs; launch nothing else now


@dataclass
class Running:
    """A trial in flight or waiting for GPUs."""

    number: int
    attempt: int
    phase: Phase
    layout: Layout
    proposal: Any  # optuna Trial (None for confirmation runs)
    predicted: dict[str, Any] | None
    run_id: str | None
    started_at: str
    slot: Reservation | None  # None while waiting for GPUs
    started: float = field(default_factory=time.monotonic)
    waiting_since: float | None = None  # when it joined the retry queue
    # Trials of the sweep ("number.attempt") that ran on one of its nodes while it ran, and the GPUs other jobs held
    # there when it started: a measurement with neighbours shares the node's links, NICs and filesystem (issue 46).
    neighbours: set[str] = field(default_factory=set)
    other_jobs_gpus: int = 0


# A trial waits in its own driver thread. The pool makes a thread only when a trial starts and no idle one is left,
# so its bound costs nothing until trials run; 64 threads left a 1,024-GPU cluster's 65th..128th trial of 8 GPUs
# holding its reservation in the executor's queue, GPUs idle (issue 46). One thread per GPU is the most a cluster of
# that size can run at once.
MAX_TRIAL_THREADS = 8192


class Scheduler:
    def __init__(self, host: Host, parallel_cap: int, never: Callable[[Layout], str | None] | None = None) -> None:
        self.host = host
        # The clock trials are timed by: a rehearsal's virtual one (trial.rehearsal), else the machine's.
        self.now: Callable[[], float] = getattr(host, "now", time.monotonic)
        # Why the capacity alive can never hold a layout (``run.capacity``: the one rule every phase waits by).
        self.never = never or CapacityWait(host, threading.Event(), self.now).never
        self.parallel_cap = min(parallel_cap, MAX_TRIAL_THREADS)
        self.pool = cf.ThreadPoolExecutor(max_workers=self.parallel_cap, thread_name_prefix="trial")
        self.futures: dict[cf.Future[TrialResult], Running] = {}
        self.cancels: dict[int, threading.Event] = {}
        self.retry: list[Running] = []
        self.deferred: list[Running] = []
        self.busy_gpu_s = 0.0
        self.durations: list[float] = []  # wall seconds of every ended trial

    # -- what is where -------------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> list[Running]:
        return list(self.futures.values())

    def has_room(self) -> bool:
        return len(self.futures) < self.parallel_cap

    @property
    def waiting(self) -> list[Running]:
        """Waiting for GPUs (retries, held proposals, deferred layouts)."""
        return self.retry + self.deferred

    def is_running(self, layout: Layout) -> bool:
        """In flight, or waiting for GPUs. (A proposal asks it of every untried layout: a Layout's hash is kept,
        its fields compared only where the hashes agree.)"""
        key = hash(layout)
        return any(hash(r.layout) == key and r.layout == layout
                   for runs in (self.futures.values(), self.retry, self.deferred) for r in runs)

    # -- the queues ------------------------------------------------------------------------------------------------
    def readmit(self) -> None:
        """Deferred layouts the alive capacity can hold again (a node joined) go back to the retry queue."""
        for run in [r for r in self.deferred if self.never(r.layout) is None]:
            self.deferred.remove(run)
            self.retry.append(run)

    def take_retry(self) -> tuple[Running, Reservation] | str | None:
        """The head of the retry queue with GPUs reserved for it; ``HOLD`` when it must wait for GPUs; None when
        the queue is empty. A head needing more GPUs than are alive moves to ``deferred`` instead of blocking."""
        while self.retry:
            run = self.retry[0]
            if self.never(run.layout) is not None:
                self.deferred.append(self.retry.pop(0))
                continue
            slot = self.host.reserve(run.layout)
            if slot is None:
                return HOLD
            self.retry.pop(0)
            return run, slot
        return None

    def hold(self, run: Running) -> None:
        """A proposal with no GPUs free now: first in line when they free up (only a backfill starts before it),
        or deferred when it needs more GPUs than are alive."""
        if self.never(run.layout) is not None:
            self.deferred.append(run)
            return
        run.waiting_since = self.now()
        self.retry.insert(0, run)

    def retry_later(self, run: Running) -> None:
        """An attempt that failed for reasons not the layout's (or a backfill that lost its GPUs): runs again as
        the next attempt, after those waiting."""
        run.waiting_since = self.now()
        self.retry.append(run)

    def may_backfill(self) -> bool:
        """Whether a smaller trial may start on the free GPUs while the head of the retry queue waits for its own:
        until the head has waited one typical trial (the median wall time of the trials ended so far; any time
        before one has ended). A backfill started then ends about one trial later, so the head is delayed by
        about one trial at most, and never starved by a stream of small ones. While other jobs hold GPUs the head
        needs (it would not fit even on every GPU they leave), smaller trials may always start: the sweep's budget
        is not spent waiting on a shared cluster, and once the other jobs free up, the rule above applies."""
        if not self.retry or self.retry[0].waiting_since is None:
            return False
        head = self.retry[0].layout
        if head.world_size > self.host.capacity_total() - self.host.held_by_others():
            # Other jobs hold GPUs it needs: the sweep's own trials on the free GPUs do not delay it (issue 51).
            return True
        if not self.durations:
            return True
        return self.now() - self.retry[0].waiting_since < statistics.median(self.durations)

    def drain_waiting(self) -> list[Running]:
        """Empty both queues, returning what was in them."""
        waiting = self.waiting
        self.retry.clear()
        self.deferred.clear()
        return waiting

    # -- launching and waiting -----------------------------------------------------------------------------------
    def submit(self, run: Running, **kwargs: Any) -> None:
        """Start ``host.run_trial`` for ``run`` on its reservation in a worker thread (``cancel_all`` stops it)."""
        assert run.slot is not None, "a trial is launched only with GPUs reserved"
        nodes = set(run.slot.node_ids)
        for other in self.futures.values():
            if other.slot is not None and nodes & set(other.slot.node_ids):
                other.neighbours.add(f"{run.number}.{run.attempt}")
                run.neighbours.add(f"{other.number}.{other.attempt}")
        run.other_jobs_gpus = self.host.held_by_others(run.slot.node_ids)
        run.started = self.now()
        cancel = threading.Event()
        future = self.pool.submit(self.host.run_trial, reservation=run.slot, cancel=cancel, **kwargs)
        self.futures[future] = run
        self.cancels[id(future)] = cancel

    def wait_one(self, timeout_s: float = 5.0) -> list[tuple[Running, TrialResult]]:
        """The trials that ended within ``timeout_s`` (at least one unless none did), their GPUs released."""
        advance = getattr(self.host, "advance", None)
        if advance is not None:  # a rehearsal: its clock moves to the next trial's end
            advance()
        done, _ = cf.wait(list(self.futures), timeout=timeout_s, return_when=cf.FIRST_COMPLETED)
        ended = []
        for future in done:
            run = self.futures.pop(future)
            self.cancels.pop(id(future), None)
            if run.slot is not None:
                self.host.release(run.slot)
            held_s = self.now() - run.started
            self.busy_gpu_s += held_s * run.layout.world_size
            self.durations.append(held_s)
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001 - a runner bug must not lose the sweep; record it as infra
                result = TrialResult(status="failed", failure_kind="infra", error=f"trial runner error: {exc}")
            ended.append((run, result))
        return ended

    def cancel_all(self) -> None:
        for event in self.cancels.values():
            event.set()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
