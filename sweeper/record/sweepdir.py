"""The sweep folder: crash-safe writes and tolerant reads of what a sweep records.

``trials.jsonl`` is appended one whole line per write and fsync'd, so a killed driver leaves at most a torn last
line, which readers skip. Everything else (sweep.json, best_layout.yaml, the report) is written to a temporary
file in the same folder and renamed over the old one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml


class SweepDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.trials = root / "trials.jsonl"
        self.meta = root / "sweep.json"
        self.best = root / "best_layout.yaml"
        self.journal = root / "optuna_journal.log"
        self.trial_dirs = root / "trials"

    def exists(self) -> bool:
        return self.trials.exists() or self.meta.exists()

    def create(self) -> None:
        self.trial_dirs.mkdir(parents=True, exist_ok=True)

    def trial_dir(self, number: int, attempt: int, phase: str = "explore") -> Path:
        suffix = "" if phase == "explore" else f"-{phase}"
        return self.trial_dirs / f"{number:04d}-a{attempt}{suffix}"

    def append_trial(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.trials, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write of one line: appends are not interleaved
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_trials(self) -> list[dict[str, Any]]:
        return read_jsonl(self.trials)

    def read_meta(self) -> dict[str, Any]:
        if not self.meta.exists():
            return {}
        try:
            return json.loads(self.meta.read_text())
        except json.JSONDecodeError:
            return {}

    def write_meta(self, meta: dict[str, Any]) -> None:
        write_atomic(self.meta, json.dumps(meta, indent=2, default=str))

    def write_best(self, data: dict[str, Any]) -> None:
        write_atomic(self.best, yaml.safe_dump(data, sort_keys=False, width=120))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line; a torn or corrupt line (a crash mid-write) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder, fsync, rename: readers see the old or the new file, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; sweep outputs are meant to be shared
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
