"""One driver per sweep folder (issue 43): ``driver.lock`` in the folder, held by ``sweeper search`` for the whole
sweep, so that a second driver (a ``--resume`` while the first still runs, a Slurm requeue) cannot interleave
trials.jsonl and the Optuna journal.

The file is created exclusively (``O_EXCL``: of two drivers starting together, one creates it), names its holder in
JSON (host, pid, start time), and carries a heartbeat: the holder touches its mtime every ``HEARTBEAT_S`` while it
runs. The holder also keeps an ``fcntl.flock`` on it, which the kernel drops with the process. A driver finding the
file already there takes it over (issue 51) when the holder provably is not running, and is refused with the holder
named otherwise:

- a flock another process holds: that driver runs (on any host the filesystem's locks reach), never taken over;
- a holder on this host whose pid is gone: stale at once;
- a heartbeat older than ``STALE_S`` (a driver killed on another host, a Slurm job requeued elsewhere), on a
  filesystem where the flock is free or unsupported: stale;
- ``--break-lock`` (``break_lock``): taken over whatever it names, unless a flock is held.

A lock taken over is deleted and created again exclusively, so two drivers taking over one stale lock are still
one holder. The file is removed on release.
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType

from sweeper.errors import UsageError

LOCK_FILE = "driver.lock"
HEARTBEAT_S = 15.0  # how often a holder touches its lock file
# A heartbeat this old means its driver is gone: eight missed beats, and room for the clocks of two hosts (the file's
# mtime is the file server's) to differ by a minute.
STALE_S = 120.0
FLOCK_RETRY_S = 5.0  # a driver that just created the file waits this long for a flock another one inspects it with
_held: set[Path] = set()  # lock files this process holds (a pid recorded in a file may be our own, reused)


class Flock(enum.Enum):
    OURS = "ours"
    BUSY = "busy"  # another open file description holds it: a running driver
    UNSUPPORTED = "unsupported"  # e.g. an NFS mount without a lock daemon: the file's JSON and heartbeat decide


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
    holder without writing anything. ``say`` gets the one line about a lock taken over; ``force``: take over a lock
    whatever its holder and heartbeat say, unless its flock is held (``--break-lock``)."""

    def __init__(self, path: Path, say: Callable[[str], None] = lambda _line: None, *, force: bool = False) -> None:
        self.path = path.absolute()
        self.say = say
        self.force = force
        self._fd: int | None = None
        self._made: list[Path] = []  # folders this lock created, deepest first: removed again if left empty
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

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
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, args=(self._fd,), name="sweeper-lock-heartbeat",
                                      daemon=True)
        self._beat.start()

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        _held.discard(self.path)
        try:
            if _same_file(fd, self.path):  # not a newer driver's file (someone broke ours meanwhile)
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # after the unlink: a driver waiting on this file then sees it is gone and retries
        self._remove_made_folders()

    def _heartbeat(self, fd: int) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(fd)  # the file server's "now" on a network filesystem
            except OSError:  # a filesystem hiccup: the next beat tries again, STALE_S allows for several
                pass

    def _take(self) -> int:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._take_over()
                continue  # the stale file is gone: create ours exclusively
            try:
                _write_holder(fd)
                # A driver inspecting our new file holds its flock for a moment; nothing else can.
                deadline = time.monotonic() + FLOCK_RETRY_S
                while _flock(fd) is Flock.BUSY:
                    if time.monotonic() >= deadline:
                        raise UsageError(f"--out: {self.path} was created by this driver but another process holds "
                                         "its lock; is another sweeper driver starting on this folder?")
                    time.sleep(0.05)
                return fd
            except BaseException:
                if _same_file(fd, self.path):
                    self.path.unlink(missing_ok=True)
                os.close(fd)
                raise

    def _take_over(self) -> None:
        """Remove the existing lock file when its holder provably is not running (the caller then creates its own),
        else raise UsageError naming the holder. Returns also when the file vanished meanwhile (released)."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            flock = _flock(fd)
            if not _same_file(fd, self.path):
                return  # released (unlinked) between our open and flock
            holder = _read_holder(fd, wait_s=1.0)  # a new holder writes just after it creates the file
            age = time.time() - os.fstat(fd).st_mtime
            why = self._stale(holder, age, flock)
            if why is None:
                raise UsageError(self._refusal(holder, age, flock))
            if _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)
            self.say(f"{self.path}: taking over the lock of a sweeper driver that is gone "
                     f"({holder or 'holder not recorded'}; {why})")
        finally:
            os.close(fd)

    def _stale(self, holder: Holder | None, age: float, flock: Flock) -> str | None:
        """Why the lock's holder is not running, or None when it may be."""
        if flock is Flock.BUSY:
            return None  # a flock is held: that driver runs, whatever its heartbeat says
        if self.force:
            return "--break-lock"
        if holder is not None and holder.gone(self.path):
            return "its pid is gone"
        if age > STALE_S:
            return f"no heartbeat for {age:.0f} s"
        return None

    def _refusal(self, holder: Holder | None, age: float, flock: Flock) -> str:
        where = f"--out: {self.path.parent} is in use by another sweeper driver ({holder or 'holder not recorded'}"
        if flock is Flock.BUSY:
            return f"{where}, holding its lock); wait for it to end"
        return (f"{where}, heartbeat {age:.0f} s ago); wait for it, or pass --break-lock if that driver is gone "
                f"(a later start takes its lock over once its heartbeat is {STALE_S:.0f} s old)")

    def _remove_made_folders(self) -> None:
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:  # not empty: the sweep wrote into it
                break
        self._made = []


def break_lock(path: Path, say: Callable[[str], None]) -> None:
    """``--break-lock``: remove the lock of a sweep folder whose driver is gone, however recent its heartbeat (a
    driver that still holds its flock is refused with UsageError). No lock file: nothing to do."""
    if path.exists():
        with DriverLock(path, say, force=True):
            pass


def _write_holder(fd: int) -> None:
    os.pwrite(fd, json.dumps(asdict(Holder.me())).encode(), 0)
    os.fsync(fd)


def _flock(fd: int) -> Flock:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return Flock.BUSY
    except OSError:  # ENOLCK, EOPNOTSUPP, ENOSYS: e.g. an NFS mount without a lock daemon
        return Flock.UNSUPPORTED
    return Flock.OURS


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
