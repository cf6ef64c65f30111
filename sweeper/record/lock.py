"""One driver per sweep folder (issue 43): ``driver.lock`` in the folder, held by ``sweeper search`` for the whole
sweep, so that a second driver (a ``--resume`` while the first still runs, a Slurm requeue) cannot interleave
trials.jsonl and the Optuna journal. The lock is an ``fcntl.flock`` on a descriptor kept open, which the kernel drops
with the process, and the file's JSON (host, pid, start time) names the holder. On a shared filesystem where flock
may not reach across hosts, the JSON is authoritative: a holder on this host whose pid is gone is stale and taken
over; a holder on another host is refused until someone deletes the file. The file is removed on release.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType

from sweeper.errors import UsageError

LOCK_FILE = "driver.lock"
_held: set[Path] = set()  # lock files this process holds (a pid recorded in a file may be our own, reused)


@dataclass(frozen=True)
class Holder:
    """The driver a lock file names."""

    pid: int
    host: str
    started_at: str

    @classmethod
    def me(cls) -> Holder:
        return cls(os.getpid(), socket.gethostname(),
                   datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def gone(self, path: Path) -> bool:
        """Provably not running: on this host, and its pid is dead (or is this process, which does not hold it)."""
        if self.host != socket.gethostname():
            return False  # another host's pid tells us nothing
        if self.pid == os.getpid():
            return path not in _held  # a container restarted under the same host name numbers its pids alike
        return not _pid_alive(self.pid)

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started_at}"


class DriverLock:
    """``with DriverLock(folder / LOCK_FILE):`` holds the folder for this driver, or raises UsageError naming the
    holder without writing anything. ``say`` gets the one line about a stale lock taken over."""

    def __init__(self, path: Path, say: Callable[[str], None] = lambda _line: None) -> None:
        self.path = path.absolute()
        self.say = say
        self._fd: int | None = None
        self._made: list[Path] = []  # folders this lock created, deepest first: removed again if left empty

    def __enter__(self) -> DriverLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def acquire(self) -> None:
        folder = self.path.parent
        self._made = [p for p in (folder, *folder.parents) if not p.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = self._take()
        except BaseException:
            self._remove_made_folders()
            raise
        _held.add(self.path)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _held.discard(self.path)
        try:
            if _same_file(fd, self.path):  # not a newer driver's file (someone deleted ours meanwhile)
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # after the unlink: a driver waiting on this file then sees it is gone and retries
        self._remove_made_folders()

    def _take(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # an existing file is left as it is
            try:
                locked = _flock(fd)
                if not _same_file(fd, self.path):  # released (unlinked) between our open and flock: again
                    os.close(fd)
                    continue
                holder = _read_holder(fd, wait_s=0.0 if locked else 1.0)  # a new holder writes just after flock
                if not locked or (holder is not None and not holder.gone(self.path)):
                    raise UsageError(
                        f"--out: {self.path.parent} is in use by another sweeper driver "
                        f"({holder or 'holder not recorded'}); wait for it, or delete {self.path} if that driver "
                        "is gone")
                if holder is not None:
                    self.say(f"{self.path}: taking over the lock of a sweeper driver that is gone "
                             f"({holder})")
                data = json.dumps(asdict(Holder.me())).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
                os.fsync(fd)
                return fd
            except BaseException:
                os.close(fd)
                raise

    def _remove_made_folders(self) -> None:
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:  # not empty: the sweep wrote into it
                break
        self._made = []


def _flock(fd: int) -> bool:
    """True when this process now holds the flock, or the filesystem has none (the JSON then decides)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP, ENOSYS: e.g. an NFS mount without a lock daemon
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _read_holder(fd: int, wait_s: float) -> Holder | None:
    """The holder the file names; None for an empty or unreadable file (after ``wait_s`` for one to appear)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            data = json.loads(os.pread(fd, 4096, 0))
            holder = Holder(int(data["pid"]), str(data["host"]), str(data["started_at"]))
            if holder.pid > 0:  # os.kill(0 or -n) would ask about a process group
                return holder
        except (ValueError, TypeError, KeyError):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
