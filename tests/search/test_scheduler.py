"""The scheduler runs as many trials at once as the cluster holds, and notes which trials shared nodes (issue 46).

The host is a STAND-IN (a fixed pool of single-GPU slots whose trials wait on an event); the scheduler is real."""

from __future__ import annotations

import threading
import time

from sweeper.record.schema import TrialResult
from sweeper.search.run.scheduler import Running, Scheduler
from sweeper.space.layout import Layout
from sweeper.trial.protocol import Reservation


class SlotsHost:
    simulated, backend_name = True, "stand-in"

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()
        self.go = threading.Event()

    def release(self, reservation: Reservation) -> None:
        pass

    def held_by_others(self, node_ids: list[str] | None = None) -> int:
        return 3 if node_ids == ["busy"] else 0  # another job holds 3 GPUs on node "busy"

    def run_trial(self, *, reservation: Reservation, cancel: threading.Event, **kwargs: object) -> TrialResult:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.go.wait(30)
        with self.lock:
            self.running -= 1
        return TrialResult(status="passed")


def test_a_thousand_gpu_cluster_runs_128_trials_at_once_not_64() -> None:
    host = SlotsHost()
    scheduler = Scheduler(host, parallel_cap=1_000_000)  # search.parallel: auto
    layout = Layout(world_size=8, gbs=8)
    try:
        for number in range(128):
            run = Running(number, 1, "explore", layout, None, None, None, "", Reservation([f"n{number}"], [f"n{number}"], 8))
            assert scheduler.has_room()
            scheduler.submit(run)
        deadline = time.monotonic() + 30
        while host.most < 128 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.most == 128
    finally:
        host.go.set()
        while scheduler.futures:
            scheduler.wait_one(5.0)
        scheduler.shutdown()


def test_trials_that_share_a_node_are_each_others_neighbours_and_other_jobs_are_counted() -> None:
    host = SlotsHost()
    scheduler = Scheduler(host, parallel_cap=8)
    layout = Layout(world_size=4, gbs=4)

    def run(number: int, nodes: list[str]) -> Running:
        return Running(number, 1, "explore", layout, None, None, None, "", Reservation(nodes, nodes, 4 // len(nodes)))

    a, b, c, d = run(1, ["n0"]), run(2, ["n0", "n1"]), run(3, ["n2"]), run(4, ["busy"])
    try:
        for r in (a, b, c, d):
            scheduler.submit(r)
    finally:
        host.go.set()
        while scheduler.futures:
            scheduler.wait_one(5.0)
        scheduler.shutdown()
    assert a.neighbours == {"2.1"} and b.neighbours == {"1.1"} and not c.neighbours
    assert (c.other_jobs_gpus, d.other_jobs_gpus) == (0, 3)
