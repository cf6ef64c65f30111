"""The one rule every phase waits for GPUs by (the reference, exploration and confirmation alike).

A layout whose GPUs are not free now waits when the capacity alive can hold it: other jobs or the sweep's own trials
hold its GPUs, and those free up. It is given up only when the capacity alive can never hold it (more GPUs than the
alive nodes have), saying so. While a phase waits with nothing of its own running, it looks again every ``POLL_S``
(a rehearsal's virtual clock moves to its next event instead) and says on the console, at most every ``SAY_EVERY_S``,
what waits and who holds the GPUs. A wait ends with the sweep (Ctrl-C) or its wall-time budget
(``search.wall_time_s``), never on its own: a shared cluster's other jobs end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sweeper.search.console import console
from sweeper.space.layout import Layout
from sweeper.trial.protocol import Host

POLL_S = 5.0  # a phase with nothing of its own running looks for free GPUs this often
SAY_EVERY_S = 60.0  # the waiting line at most this often (the first one at once)
LACKS_S = 5.0  # what the alive nodes lack for a layout is asked again after this long (nodes join and leave)


class CapacityWait:
    """Waiting for GPUs held by others, for every phase of one sweep."""

    def __init__(self, host: Host, stop: threading.Event, clock: Callable[[], float]) -> None:
        self.host, self.stop, self.clock = host, stop, clock
        self._said: dict[str, float] = {}  # what waits -> when it was last said (the clock's seconds)
        self.waited_s = 0.0  # how long phases waited with nothing of their own running (sweep.json)
        self._lacks: dict[Layout, tuple[float, str | None]] = {}  # layout -> (when asked, what the nodes lack)

    def never(self, layout: Layout) -> str | None:
        """Why the capacity alive can never hold ``layout`` (None: it can, once its GPUs free up): fewer GPUs alive
        than it needs, or no placement of it on the alive nodes (``lacks``: what a node lacks, GPUs or the CPUs its
        ranks reserve; asked at most every LACKS_S per layout, as it reads the cluster's node table)."""
        alive = self.host.capacity_total()
        if layout.world_size > alive:
            return f"needs {layout.world_size} GPUs, {alive} alive"
        lacks = getattr(self.host, "lacks", None)
        if lacks is None:
            return None
        now = self.clock()
        cached = self._lacks.get(layout)
        if cached is None or now - cached[0] >= LACKS_S:
            cached = self._lacks[layout] = (now, lacks(layout))
        return cached[1]

    def idle(self, what: str, layout: Layout) -> None:
        """Nothing of the sweep's own runs and ``what`` (e.g. "trial #3") waits for ``layout``'s GPUs: say so (at
        most every SAY_EVERY_S) and wait one poll (or until the sweep is stopped)."""
        others = self.host.held_by_others()
        line = (f"[yellow]waiting[/] {what} {layout.short()} waits for {layout.world_size} GPUs: "
                + (f"{others} GPUs held by other jobs" if others else "not free yet (nodes starting or just released)")
                + f", {self.host.capacity_total()} alive")
        now, key = self.clock(), f"{what} {layout.short()}"  # once a minute per waiting thing, however others change
        if now - self._said.get(key, -SAY_EVERY_S) >= SAY_EVERY_S:
            self._said[key] = now
            console.print(line, important=True)
        before = self.clock()
        advance = getattr(self.host, "advance", None)
        if advance is not None:  # a rehearsal: its clock moves to the next trial's end or the next change of others
            advance()
        else:
            self.stop.wait(POLL_S)
        self.waited_s += self.clock() - before
