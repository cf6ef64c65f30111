"""search.propose.dominance: what a measured trial decides about the layouts one axis away (pure; results are built here,
no trial runs)."""

from __future__ import annotations

from sweeper.record.schema import TrialMetrics, TrialResult
from sweeper.search.propose.dominance import Dominance
from sweeper.space.layout import Layout

OOM = TrialResult(status="failed", failure_kind="oom", error="out of memory")
PASSED = TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=1.0, peak_memory_gib=1.0))


def _lo(**axes: object) -> Layout:
    return Layout(world_size=4, gbs=16, **axes)  # type: ignore[arg-type]


def test_an_oom_dominates_larger_micro_batches_of_the_same_layout_only() -> None:
    d = Dominance()
    assert d.add(3, _lo(tp=2, mbs=2), OOM, stable=False)
    assert "micro-batch 2 of this layout ran out of memory (trial #3" in (d.verdict(_lo(tp=2, mbs=4)) or "")
    assert d.verdict(_lo(tp=2, mbs=1)) is None  # smaller: may fit
    assert d.verdict(_lo(tp=2, mbs=4, pp=2)) is None  # another layout
    assert d.verdict(_lo(tp=4, mbs=4)) is None
    assert not d.add(4, _lo(tp=2, mbs=4), OOM, stable=False)  # nothing new
    assert d.add(5, _lo(tp=2, mbs=1), OOM, stable=False)  # a smaller OOM widens it
    assert "trial #5" in (d.verdict(_lo(tp=2, mbs=2)) or "")


def test_a_stable_layout_without_recompute_dominates_its_recompute_variants() -> None:
    d = Dominance()
    assert d.add(1, _lo(tp=2), PASSED, stable=True)
    for recompute in ("selective", "full", "selective:mlp"):
        assert "without recompute is stable (trial #1" in (d.verdict(_lo(tp=2, recompute=recompute)) or "")
    assert d.verdict(_lo(tp=2)) is None
    assert d.verdict(_lo(tp=2, mbs=2, recompute="full")) is None  # another layout


def test_passing_over_the_headroom_or_with_recompute_dominates_nothing() -> None:
    d = Dominance()
    assert not d.add(1, _lo(tp=2), PASSED, stable=False)  # passed, but over the headroom: recompute may make it
    assert not d.add(2, _lo(tp=2, recompute="full"), PASSED, stable=True)
    assert d.verdict(_lo(tp=2, recompute="selective")) is None
    assert not d.add(3, _lo(tp=2), TrialResult(status="failed", failure_kind="nan", error="nan"), stable=False)


def test_a_stable_layout_dominates_its_smaller_twins_of_the_same_production_layout() -> None:
    # issue 53: TP1-DP2 on 2 GPUs and TP1-DP4 on 4 are one production layout on 8; the larger trial stands for both
    def production(lo: Layout) -> Layout:
        k = 8 // lo.world_size
        return Layout(world_size=8, gbs=lo.gbs * k, tp=lo.tp, pp=lo.pp, mbs=lo.mbs)

    d = Dominance(production)
    small, large = Layout(world_size=2, gbs=4), Layout(world_size=4, gbs=8)
    assert d.add(7, large, PASSED, stable=True)
    assert "trial #7" in (d.verdict(small) or "") and "stable on 4 GPUs" in (d.verdict(small) or "")
    assert d.verdict(large) is None  # itself
    assert d.verdict(Layout(world_size=2, gbs=4, pp=2)) is None  # another production layout
    assert d.verdict(Layout(world_size=8, gbs=16)) is None  # a larger twin says more: not dominated
    failed = Dominance(production)
    failed.add(8, large, OOM, stable=False)
    assert failed.verdict(small) is None  # only a stable trial stands for its twins
    assert Dominance().verdict(small) is None  # off without the production run's shape
