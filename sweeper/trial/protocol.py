"""What the sweep needs from the cluster side, as a type: the ``TrialHost`` protocol and its ``Reservation``.

``trial.host.TrialHost`` implements it on a Ray cluster; the sweep loop, the scheduler and the reference trial are
written against the protocol, so a test's stand-in host is checked against the same surface. ``reserved`` holds a
reservation for one block (a single trial, the reference run).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sweeper.config.schema import SweepConfig
    from sweeper.models.spec import ModelSpec
    from sweeper.record.schema import TrialResult
    from sweeper.space.layout import Layout


@dataclass(frozen=True)
class Reservation:
    """GPUs held for one trial: the nodes of its placement bundles, in bundle order."""

    node_ids: list[str]  # one per placement bundle
    labels: list[str]
    gpus_per_bundle: int
    alone: bool = False  # no other trial of the sweep may start on these nodes while it is held


@runtime_checkable
class Host(Protocol):
    simulated: bool
    backend_name: str

    def capacity_total(self) -> int:
        """GPUs on the nodes alive now."""

    def held_by_others(self, node_ids: list[str] | None = None) -> int:
        """GPUs other jobs hold now on ``node_ids`` (None: every alive node); never reserved for a trial until
        they free up."""

    def reserve(self, layout: Layout, alone: bool = False) -> Reservation | None:
        """GPUs for ``layout`` if they are free now (the ledger counts them used until ``release``); ``alone``: on
        nodes no other trial of the sweep uses, kept so until ``release``."""

    def fits(self, layout: Layout) -> bool:
        """Whether ``reserve`` would find GPUs for ``layout`` now; reserves nothing."""

    def reserve_within(self, layout: Layout, timeout_s: float) -> Reservation | None:
        """``reserve``, retried for up to ``timeout_s``."""

    def release(self, reservation: Reservation) -> None: ...

    def prestart(self, layouts: list[Layout]) -> int:
        """Start warm ranks for the largest of ``layouts`` before the first trial (where the host keeps any);
        how many were started."""

    def unsupported(self, model: ModelSpec, layout: Layout) -> str | None:
        """Why this backend cannot run the layout, or None."""

    def run_trial(self, cfg: SweepConfig, layout: Layout, trial_dir: Path, *, reservation: Reservation,
                  inject: str | None = None, cancel: threading.Event | None = None,
                  steps: int | None = None, reference: str | None = None,
                  make_reference: bool = False, routing_stress: bool = False) -> TrialResult: ...

    def add_node(self) -> str:
        """node-join fault injection (simulated clusters)."""


@contextlib.contextmanager
def reserved(host: Host, layout: Layout, timeout_s: float) -> Iterator[Reservation | None]:
    """``host.reserve_within`` for the block, released when it ends (None: no free nodes in time)."""
    slot = host.reserve_within(layout, timeout_s)
    try:
        yield slot
    finally:
        if slot is not None:
            host.release(slot)
