"""The declared compute capability against the one a GPU reports (issue 44, item 6)."""

from __future__ import annotations

from sweeper.config.capability import capability_mismatch


def test_a_capability_that_differs_from_the_declared_one_is_one_line_naming_both() -> None:
    problem = capability_mismatch("9.0", "10.0", "rank 3's GPU (NVIDIA B200)")
    assert problem is not None and "\n" not in problem
    assert problem.startswith("cluster.compute_capability is 9.0 but rank 3's GPU (NVIDIA B200) is 10.0")
    assert problem.endswith('(set cluster.compute_capability: "10.0")')


def test_the_same_capability_or_none_reported_is_no_problem() -> None:
    assert capability_mismatch("9.0", "9.0", "x") is None
    assert capability_mismatch("12.0", "12.0", "x") is None
    assert capability_mismatch("9.0", None, "x") is None  # no GPU, or a probe that could not tell
    assert capability_mismatch("8.9", "9.0", "x") is not None
