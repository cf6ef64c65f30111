"""When a failure that is not the layout's stops being worth a retry (sweeper/search/run/repeated.py)."""

from __future__ import annotations

from sweeper.record.schema import TrialMetrics, TrialResult
from sweeper.search.run.repeated import RepeatedFailure, cause_of
from sweeper.trial.runner import NODE_LOST, PLACEMENT_TIMEOUT

START = "rank {rank} (sim-{node}): rank actor failed to start: RuntimeError: NVML does not answer (pid={pid})"


def infra(rank: int = 0, node: int = 0, pid: int = 100, notes: list[str] | None = None) -> TrialResult:
    return TrialResult(status="failed", failure_kind="infra", error=START.format(rank=rank, node=node, pid=pid),
                       notes=notes or [])


def passed() -> TrialResult:
    return TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=1.0))


def test_a_cause_is_the_error_without_its_rank_node_and_numbers():
    assert cause_of(START.format(rank=3, node=1, pid=77)) == cause_of(START.format(rank=0, node=0, pid=4242))
    assert cause_of(START.format(rank=0, node=0, pid=1)) != cause_of("rank 0 (sim-0): rank lost: node died")


def test_three_layouts_one_retried_on_one_cause_stop_the_sweep():
    watch = RepeatedFailure()
    assert watch.add("a", 1, infra(pid=1)) is None
    assert watch.add("b", 1, infra(rank=2, node=1, pid=2)) is None
    assert watch.add("c", 1, infra(pid=3)) is None  # three layouts, but nothing retried yet: one event may do that
    line = watch.add("a", 2, infra(pid=4))
    assert line is not None and line.startswith("stopped: every attempt of 3 layouts")
    assert line.endswith("RuntimeError: NVML does not answer (pid=4)")


def test_an_attempt_that_reaches_its_layout_in_between_starts_the_count_again():
    watch = RepeatedFailure()
    watch.add("a", 1, infra())
    watch.add("a", 2, infra())
    watch.add("b", 1, infra())
    assert watch.add("x", 1, passed()) is None
    watch.add("c", 1, infra())
    assert watch.add("b", 2, infra()) is None  # b and c since the pass: two layouts
    assert watch.add("d", 1, infra()) is not None


def test_lost_nodes_and_placement_timeouts_pass_and_never_stop_a_sweep():
    watch = RepeatedFailure()
    for layout in "abcdefgh":  # a node of eight one-GPU trials lost at once, then retried: each lost again
        for attempt in (1, 2):
            assert watch.add(layout, attempt, infra(notes=[NODE_LOST])) is None
            assert watch.add(layout, attempt, infra(notes=[PLACEMENT_TIMEOUT])) is None


def test_another_cause_starts_its_own_streak():
    watch = RepeatedFailure()
    watch.add("a", 1, infra())
    watch.add("a", 2, infra())
    other = TrialResult(status="failed", failure_kind="infra", error="rank 0 (sim-0): rank lost: connection reset")
    assert watch.add("b", 1, other) is None
    assert watch.add("c", 1, infra()) is None  # the NVML streak restarted at c
