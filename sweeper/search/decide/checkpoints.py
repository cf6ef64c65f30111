"""The trials' checkpoints at a sweep's end (issue 43, ``training.keep_checkpoints``).

A trial writes a full checkpoint of its layout (a 30B-class model: ~60 GB), so a sweep's trials would fill a
shared filesystem. ``none``: each trial deletes its own after the bitwise reload (the rank does,
``backends/megatron/smoke.py``); what is left here is a failed trial's (no safe point to delete it while a peer may
still write or read it) or one whose deletion failed. ``winner``: the trials keep theirs and the end keeps only
the winner's (its exploration's and its confirmations'). ``all``: nothing is deleted. Only ``<trial_dir>/checkpoint``
folders are touched: the sweep's equivalence reference (``reference/``) is never deleted. A deletion that fails is
recorded, never the sweep's failure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sweeper.config.schema import KeepCheckpoints
from sweeper.config.units import GIB
from sweeper.record.checkpoints import checkpoint_folder, delete_checkpoint, folder_bytes
from sweeper.record.schema import TrialRecord


@dataclass
class Pruned:
    """What ``prune_checkpoints`` did: ``sweep.json`` ``checkpoints``."""

    keep: KeepCheckpoints
    kept: list[str] = field(default_factory=list)  # the checkpoint folders left on disk
    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    failed: list[str] = field(default_factory=list)  # one line per folder that could not be deleted (it stays)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str | None:
        """One console line when the end deleted or failed to delete something; None otherwise."""
        if not self.deleted and not self.failed:
            return None
        text = (f"checkpoints: deleted {len(self.deleted)} trial checkpoint(s), {self.freed_bytes / GIB:.2f} GiB "
                f"freed (training.keep_checkpoints: {self.keep})")
        if self.failed:
            text += f"; {len(self.failed)} could not be deleted (sweep.json checkpoints.failed)"
        return text


def prune_checkpoints(records: Iterable[TrialRecord], keep: KeepCheckpoints, winner_number: int | None) -> Pruned:
    """Delete the ``checkpoint/`` folder of each record's trial that ``keep`` does not keep: with ``winner`` every
    one but those of trial ``winner_number``'s runs (all of them when there is no winner), with ``none`` every one
    left, with ``all`` none. Call it when the sweep has finished: an interrupted sweep may resume and choose
    another winner."""
    out = Pruned(keep)
    seen: set[Path] = set()
    for record in records:
        if record.result.trial_dir is None:
            continue
        folder = checkpoint_folder(record.result.trial_dir)
        if folder in seen or not (folder.exists() or folder.is_symlink()):
            continue
        seen.add(folder)
        if keep == "all" or (keep == "winner" and record.number == winner_number):
            out.kept.append(str(folder))
            continue
        size = folder_bytes(folder)
        problem = delete_checkpoint(folder)
        if problem is None:
            out.deleted.append(str(folder))
            out.freed_bytes += size
        else:
            out.failed.append(problem)
            out.kept.append(str(folder))
    return out
