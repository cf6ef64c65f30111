"""Hang forensics: where each rank was when a trial ran out of time.

Every rank arms Python's ``faulthandler.dump_traceback_later`` for a moment just before the trial's wall-time limit
(``SmokeRequest.stack_dump_at``, wall-clock seconds). A rank still running then writes every thread's stack into
``<trial>/stacks/rank_NNN.txt`` by itself: no signal has to reach it across nodes, and a rank blocked inside a
C call (a gloo or NCCL collective) dumps too, since faulthandler's watchdog thread does the writing. A rank that
finishes in time cancels the dump and leaves no file. When the runner then stops the trial, ``blocked_in`` reads
the files and names, for each rank, the collective (or the function) its backend thread was in, and who called it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

STACKS_DIR = "stacks"
_HEADER = "backend thread "
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)$')
_COLLECTIVES = "torch/distributed/"
_WRAPPERS = frozenset({"wrapper", "inner", "wrapped", "decorated", "_fn"})


def dump_time(limit_s: float) -> float:
    """When ranks dump their stacks for a trial of ``limit_s`` starting now: shortly before the limit, so the files
    are written before the runner stops the ranks (5 s before, or a quarter of a short limit)."""
    return time.time() + limit_s - min(5.0, 0.25 * limit_s)


@contextlib.contextmanager
def armed(trial_dir: str, rank: int, dump_at: float | None) -> Iterator[None]:
    """For the block: this process dumps every thread's stack at ``dump_at`` unless the block ended before."""
    if dump_at is None:
        yield
        return
    path = Path(trial_dir) / STACKS_DIR / f"rank_{rank:03d}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("w", encoding="utf-8")
    except OSError:  # forensics must never cost the trial
        yield
        return
    # The thread running the backend (a Ray actor may run it outside the process's main thread).
    header = f"{_HEADER}0x{threading.get_ident():016x}\n"
    handle.write(header)
    handle.flush()  # faulthandler writes to the descriptor itself, after the header
    faulthandler.dump_traceback_later(max(dump_at - time.time(), 0.05), repeat=False, file=handle, exit=False)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        handle.close()
        if path.stat().st_size <= len(header):  # finished in time: nothing was dumped, nothing is left
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # another rank's dump may be in the folder
                path.parent.rmdir()


def backend_stack(text: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the frames of the thread that ran the backend, most recent first."""
    lines = text.splitlines()
    ours = lines[0].removeprefix(_HEADER).strip() if lines and lines[0].startswith(_HEADER) else None
    frames: list[tuple[str, int, str]] = []
    current: str | None = None
    for line in lines[1:]:
        thread = _THREAD.match(line)
        if thread:
            if frames:  # the backend thread's block ended
                break
            current = thread.group(1)
            continue
        frame = _FRAME.match(line)
        if frame and current is not None and (ours is None or int(current, 16) == int(ours, 16)):
            frames.append((frame["file"], int(frame["line"]), frame["func"]))
    return frames


def where(frames: list[tuple[str, int, str]]) -> str:
    """One phrase: the torch.distributed call a rank was blocked in and its caller, or its innermost function."""
    if not frames:
        return "no Python frame"
    depth = 0
    while depth < len(frames) and _COLLECTIVES in frames[depth][0]:
        depth += 1
    if depth:
        # The torch.distributed function its caller called, past the decorators torch wraps it in (c10d_logger).
        entry = next((f[2] for f in reversed(frames[:depth]) if f[2] not in _WRAPPERS), frames[0][2])
        caller = f", called from {_place(frames[depth])}" if depth < len(frames) else ""
        return f"blocked in torch.distributed {entry}{caller}"
    return f"in {_place(frames[0])}"


def blocked_in(trial_dir: str | Path) -> str | None:
    """Each rank's place at the dump, ranks in the same place named together; None when no rank dumped."""
    folder = Path(trial_dir) / STACKS_DIR
    places: dict[str, list[int]] = {}
    for path in sorted(folder.glob("rank_*.txt")):
        try:
            rank = int(path.stem.removeprefix("rank_"))
            places.setdefault(where(backend_stack(path.read_text(encoding="utf-8", errors="replace"))), []).append(rank)
        except (OSError, ValueError):
            continue
    if not places:
        return None
    parts = [f"{'rank' if len(ranks) == 1 else 'ranks'} {','.join(map(str, ranks))} {place}"
             for place, ranks in sorted(places.items(), key=lambda kv: kv[1])]
    return "; ".join(parts) + f" (stacks in {folder})"


def _place(frame: tuple[str, int, str]) -> str:
    file, line, func = frame
    parts = Path(file).parts
    for anchor in ("site-packages", "sweeper", "tests"):
        if anchor in parts:
            parts = parts[parts.index(anchor) + (anchor == "site-packages"):]
            break
    else:  # the standard library: the path below lib/python3.X
        stdlib = [i for i, part in enumerate(parts) if part.startswith("python3")]
        if stdlib:
            parts = parts[stdlib[-1] + 1:]
    return f"{func} ({'/'.join(parts[-4:])}:{line})"
