"""A trial's checkpoint folder on disk (issue 43): where it is, how many bytes it holds, and its deletion.

The smoke run writes every save of a trial under ``<trial_dir>/checkpoint/`` (one ``iter_NNNNNNN`` folder per
save). The rank that settles the checkpoint after its reload (``backends/megatron/smoke.py``) and the sweep's
pruning at its end (``search/checkpoints.py``) both measure and delete it here. A deletion never raises (it says
why it did not happen), and never touches a folder that holds ``reference.json``: that is a checkpoint the
equivalence gate or ``sweeper migrate`` reads, not a trial's own.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CHECKPOINT_DIR = "checkpoint"
REFERENCE_FILE = "reference.json"  # the equivalence reference's record (backends/megatron/equivalence.py)


def checkpoint_folder(trial_dir: str | Path) -> Path:
    """The folder holding every save of the trial in ``trial_dir``."""
    return Path(trial_dir) / CHECKPOINT_DIR


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder`` (0 when it is absent); links are not followed, an entry that
    cannot be read counts nothing."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def delete_checkpoint(folder: Path) -> str | None:
    """Delete a trial's checkpoint folder; None when it is gone (or never existed), else one line saying why it is
    still there. Never raises."""
    try:
        if not folder.exists() and not folder.is_symlink():
            return None
        if any(folder.rglob(REFERENCE_FILE)):
            return f"{folder} holds {REFERENCE_FILE} (a reference checkpoint), never deleted"
        shutil.rmtree(folder)
    except OSError as exc:
        return f"{folder} could not be deleted: {exc}"
    return None
