"""A failure that is not the layouts' and not transient either: the same cause on every attempt of several layouts.

A failure that says nothing about the layout (``selection.NOT_THE_LAYOUTS``) is run again, up to
``loop.MAX_ATTEMPTS``: a lost node or a busy cluster passes. A cause that every attempt of several layouts hits in
a row (a rank process that cannot start on this install, a missing library, a sweeper bug on a common path) does
not: run again, each layout spends its attempts on it and the sweep spends its budget. ``RepeatedFailure`` watches
the ended attempts; once ``LAYOUTS`` distinct layouts, one of them retried, ended on the same cause with nothing
in between that reached a layout, the sweep stops with that cause in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sweeper.record.schema import TrialResult
from sweeper.search.decide.verdicts import NOT_THE_LAYOUTS
from sweeper.trial.runner import CANCELLED, HOST_OUT_OF_MEMORY, NODE_LOST, PLACEMENT_TIMEOUT

LAYOUTS = 3  # distinct layouts whose attempts all ended on one cause before the sweep stops
PASSING = (NODE_LOST, PLACEMENT_TIMEOUT, CANCELLED, HOST_OUT_OF_MEMORY)  # causes that pass or are handled apart

_WHERE = re.compile(r"^rank \d+ \([^)]*\): ")  # aggregate.describe's prefix: which rank, which node
_VARYING = re.compile(r"0x[0-9a-fA-F]+|[0-9a-fA-F]{12,}|\d+")  # addresses, ids, pids, ports, counts


def cause_of(error: str | None) -> str:
    """An error as a cause: without the rank and node it hit and the numbers that differ between attempts."""
    return _VARYING.sub("#", _WHERE.sub("", error or ""))


@dataclass
class RepeatedFailure:
    """The streak of ended attempts that failed, not for their layout's sake, on one cause."""

    layouts: int = LAYOUTS
    _cause: str | None = None
    _keys: set[object] = field(default_factory=set)
    _retried: bool = False

    def add(self, layout: object, attempt: int, result: TrialResult) -> str | None:
        """Record an ended attempt of ``layout`` (any hashable key). Returns the line to stop the sweep with once
        the cause has repeated on ``layouts`` layouts, else None."""
        if result.failure_kind not in NOT_THE_LAYOUTS:
            self._cause = None  # an attempt reached its layout: the infrastructure works
            return None
        if any(note in PASSING for note in result.notes):
            return None
        cause = cause_of(result.error)
        if cause != self._cause:
            self._cause, self._keys, self._retried = cause, set(), False
        self._keys.add(layout)
        self._retried = self._retried or attempt > 1
        if len(self._keys) < self.layouts or not self._retried:
            return None
        return (f"stopped: every attempt of {len(self._keys)} layouts failed with the same cause, which is not "
                f"theirs and did not pass on a retry ({result.failure_kind}): {result.error}")


__all__ = ["LAYOUTS", "RepeatedFailure", "cause_of"]
