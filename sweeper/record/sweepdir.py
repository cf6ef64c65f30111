"""The sweep folder: crash-safe writes and tolerant reads of what a sweep records.

``trials.jsonl`` is appended one whole line per write and fsync'd, so a killed driver leaves at most a torn last
line, which readers skip. Everything else (sweep.json, best_layout.yaml, the report) is written to a temporary
file in the same folder and renamed over the old one. ``sweep.json`` is read from the file once per ``SweepDir`` and
held: the driver holding ``driver.lock`` is its only writer, so what it last wrote is what the file says.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import orjson
import yaml

from sweeper.config.files import write_atomic
from sweeper.record.lock import LOCK_FILE
from sweeper.record.schema import SweepMeta, TrialRecord

# sweep.json's lists of one entry per layout (every layout pruned on memory, dominated or unsupported: 16,576 pruned
# in DeepSeek-V3's 1,024-GPU space), rewritten whenever the verdicts change: one compact entry per line, through
# json's C encoder (its indented one is pure Python, 0.5 s a write there).
PER_LAYOUT = ("memory_pruned", "dominated", "unsupported")
# space.yaml's header: one line per --set item the sweep was started with, applied over the YAML below it.
SET_HEADER = "# applied over this file: --set "


def meta_text(meta: SweepMeta, rows: dict[int, tuple[Any, str]] | None = None) -> str:
    """sweep.json's text: indented, each per-layout list one entry per line. The lists' entries are JSON already
    (plain dicts the frontier built), so they skip pydantic's serializer (seconds for tens of thousands of entries).
    ``rows``: each entry's line as the last call wrote it, by the entry's id, kept for the next call (an entry is a
    new dict whenever what it says changes, never one changed in place: tens of thousands of unchanged lines are
    not encoded again, issue 54)."""
    data = meta.model_dump(mode="json", exclude_unset=True, exclude=set(PER_LAYOUT))
    data.update({key: getattr(meta, key) for key in PER_LAYOUT if key in meta.model_fields_set})
    lists = {key: data[key] for key in PER_LAYOUT if data.get(key)}
    marked = {key: f"\0{key}" if key in lists else value for key, value in data.items()}
    text = json.dumps(marked, indent=2, default=str)
    kept = rows if rows is not None else {}
    written: dict[int, tuple[Any, str]] = {}
    for key, entries in lists.items():
        lines = []
        for entry in entries:
            row = kept.get(id(entry))
            if row is None or row[0] is not entry:
                row = (entry, "    " + json.dumps(entry, default=str))
            written[id(entry)] = row
            lines.append(row[1])
        text = text.replace(json.dumps(f"\0{key}"), "[\n" + ",\n".join(lines) + "\n  ]", 1)
    if rows is not None:
        rows.clear()
        rows.update(written)  # the entries of this write only (those replaced are let go)
    return text


class SweepDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.trials = root / "trials.jsonl"
        self.meta = root / "sweep.json"
        self.best = root / "best_layout.yaml"
        self.journal = root / "optuna_journal.log"
        self.space = root / "space.yaml"  # the search YAML the sweep was started with, as given
        self.trial_dirs = root / "trials"
        self.lock = root / LOCK_FILE  # held by the one driver writing this folder (issue 43)
        self._meta: SweepMeta | None = None  # sweep.json as last read or written through this object
        self._rows: dict[int, tuple[Any, str]] = {}  # its per-layout lists' lines as last written (``meta_text``)

    def exists(self) -> bool:
        return self.trials.exists() or self.meta.exists()

    def create(self) -> None:
        self.trial_dirs.mkdir(parents=True, exist_ok=True)

    def trial_dir(self, number: int, attempt: int, phase: str = "explore") -> Path:
        suffix = "" if phase == "explore" else f"-{phase}"
        return self.trial_dirs / f"{number:04d}-a{attempt}{suffix}"

    def append_trial(self, record: TrialRecord) -> None:
        line = (json.dumps(record.to_json(), separators=(",", ":")) + "\n").encode()
        fd = os.open(self.trials, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write of one line: appends are not interleaved
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_trials(self) -> list[TrialRecord]:
        return read_trials(self.trials)[0]

    def space_overrides(self) -> list[str]:
        """The ``--set`` items the sweep was started with (space.yaml's header)."""
        text = self.space.read_text(encoding="utf-8") if self.space.is_file() else ""
        return [line[len(SET_HEADER):] for line in text.splitlines() if line.startswith(SET_HEADER)]

    def read_meta(self) -> SweepMeta:
        """sweep.json; an empty one when it is missing or unreadable. Read from the file the first time, then the
        object last read or written (a 14 MB sweep.json took seconds to parse and validate on every event)."""
        if self._meta is None:
            self._meta = read_meta(self.meta) or SweepMeta()
        return self._meta

    def write_meta(self, meta: SweepMeta) -> None:
        write_atomic(self.meta, meta_text(meta, self._rows))
        self._meta = meta

    def write_best(self, data: dict[str, Any], exports: dict[str, str], executable: set[str]) -> None:
        """best_layout.yaml and the winner's exports beside it (``executable``: the names of scripts)."""
        write_atomic(self.best, yaml.safe_dump(data, sort_keys=False, width=120))
        for name, text in exports.items():
            write_atomic(self.root / name, text, 0o755 if name in executable else 0o644)


def read_trials(path: Path) -> tuple[list[TrialRecord], int]:
    """Every readable record of a trials.jsonl, and how many non-empty lines were not one (a torn last line
    after a crash, a corrupt or foreign line)."""
    if not path.exists():
        return [], 0
    out: list[TrialRecord] = []
    skipped = 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            out.append(TrialRecord.from_json(json.loads(line)))
        except (ValueError, TypeError, KeyError, AttributeError):
            skipped += 1
    return out, skipped


def read_meta(path: Path) -> SweepMeta | None:
    """sweep.json, or None when it is missing or not JSON."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:  # orjson: a DeepSeek-V3 rehearsal's 37 MB in 0.24 s, json's 0.31 (replan opens it; issue 54)
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:  # also a NaN or Infinity, which json.dumps writes and orjson does not read
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError:
            return None
    return SweepMeta.from_json(data)
