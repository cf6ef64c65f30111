"""The scheduler runs as many trials at once as the cluster holds (issue 46): no thread cap below that.

The host is a STAND-IN (a fixed pool of single-GPU slots whose trials wait on an event); the scheduler is real."""

from __future__ import annotations

import threading
import time

from sweeper.record.schema import TrialResult
from sweeper.search.scheduler import Running, Scheduler
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
