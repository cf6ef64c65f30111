"""One driver per sweep folder (issue 43): a second driver is refused with the holder named and writes nothing; a
stale lock of a dead driver on this host is taken over; a lock naming another host is refused while its heartbeat is
fresh and taken over once it is stale or with --break-lock, never while its flock is held; of drivers starting
together one holds the folder (issue 51); the lock goes with the driver however it exits."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sweeper.errors import UsageError
from sweeper.record.lock import LOCK_FILE, STALE_S, DriverLock, break_lock
from sweeper.record.schema import SweepMeta
from sweeper.record.sweepdir import SweepDir

ROOT = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process (until the kernel reuses it, far later)
    return proc.pid


def _write_holder(path: Path, pid: int, host: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"pid": pid, "host": host, "started_at": "2026-12-06T01:00:00Z"})
    path.write_text(text)
    return text


def test_a_lock_held_by_a_driver_refuses_a_second_one_naming_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "sweep" / LOCK_FILE
    with DriverLock(path):
        held = path.read_text()
        record = json.loads(held)
        assert (record["pid"], record["host"]) == (os.getpid(), socket.gethostname())
        with pytest.raises(UsageError) as refused:
            DriverLock(path).acquire()
        assert str(refused.value) == (
            f"--out: {path.parent} is in use by another sweeper driver (pid {os.getpid()} on "
            f"{socket.gethostname()}, started {record['started_at']}, holding its lock); wait for it to end")
        assert path.read_text() == held  # the refused driver wrote nothing
    assert not path.exists()


def test_a_stale_lock_of_a_dead_driver_on_this_host_is_taken_over_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / LOCK_FILE
    dead = _dead_pid()
    _write_holder(path, dead, socket.gethostname())
    said: list[str] = []
    with DriverLock(path, say=said.append):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert said == [f"{path}: taking over the lock of a sweeper driver that is gone (pid {dead} on "
                    f"{socket.gethostname()}, started 2026-12-06T01:00:00Z; its pid is gone)"]
    assert not path.exists()


def test_a_lock_naming_this_process_that_it_does_not_hold_is_stale(tmp_path: Path) -> None:
    """A container restarted under the same host name numbers its pids alike: the new driver may get the old pid."""
    path = tmp_path / LOCK_FILE
    _write_holder(path, os.getpid(), socket.gethostname())
    said: list[str] = []
    with DriverLock(path, say=said.append):
        pass
    assert len(said) == 1


def test_a_lock_naming_another_host_with_a_fresh_heartbeat_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """On a shared filesystem flock may not reach the other host, and its pids tell nothing: its heartbeat does."""
    path = tmp_path / LOCK_FILE
    text = _write_holder(path, 1234, "host-a.invalid")
    with pytest.raises(UsageError, match=r"in use by another sweeper driver \(pid 1234 on host-a.invalid, started "
                       r"2026-12-06T01:00:00Z, heartbeat \d+ s ago\); wait for it, or pass --break-lock if that "
                       r"driver is gone \(a later start takes its lock over once its heartbeat is 120 s old\)"):
        DriverLock(path).acquire()
    assert path.read_text() == text


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_dead_driver_on_another_host_is_taken_over_once_its_heartbeat_is_stale(tmp_path: Path) -> None:
    """A Slurm job requeued onto another host: the old driver was killed there; its file stays, its heartbeat stops."""
    path = tmp_path / LOCK_FILE
    _write_holder(path, 1234, "host-a.invalid")
    _age(path, STALE_S + 30)
    said: list[str] = []
    with DriverLock(path, say=said.append):
        assert json.loads(path.read_text())["host"] == socket.gethostname()
    assert len(said) == 1 and said[0].startswith(f"{path}: taking over the lock of a sweeper driver that is gone (pid "
                                                 "1234 on host-a.invalid, started 2026-12-06T01:00:00Z; no heartbeat "
                                                 "for 15")
    assert not path.exists()


def test_break_lock_takes_over_a_dead_driver_on_another_host_before_its_heartbeat_is_stale(tmp_path: Path) -> None:
    path = tmp_path / LOCK_FILE
    _write_holder(path, 1234, "host-a.invalid")
    said: list[str] = []
    break_lock(path, say=said.append)
    assert said == [f"{path}: taking over the lock of a sweeper driver that is gone (pid 1234 on host-a.invalid, "
                    "started 2026-12-06T01:00:00Z; --break-lock)"]
    assert not path.exists()
    with DriverLock(path):  # the next driver creates its own
        assert json.loads(path.read_text())["pid"] == os.getpid()
    break_lock(path, say=said.append)  # no lock: nothing to break, nothing said
    assert len(said) == 1 and not path.exists()


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_neither_a_stale_heartbeat_nor_break_lock_takes_a_lock_whose_flock_is_held(tmp_path: Path) -> None:
    """A flock held is a driver running (on a host the filesystem's locks reach), whatever its file says."""
    path = tmp_path / LOCK_FILE
    text = _write_holder(path, 1234, "host-a.invalid")
    _age(path, STALE_S + 30)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for take in (lambda: DriverLock(path).acquire(), lambda: break_lock(path, say=print)):
            with pytest.raises(UsageError, match=r"pid 1234 on host-a.invalid, started 2026-12-06T01:00:00Z, holding "
                               r"its lock\); wait for it to end"):
                take()
        assert path.read_text() == text
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_refreshes_its_heartbeat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sweeper.record.lock.HEARTBEAT_S", 0.05)
    path = tmp_path / LOCK_FILE
    with DriverLock(path):
        _age(path, STALE_S + 30)
        deadline = time.monotonic() + 5
        while time.time() - path.stat().st_mtime > 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.time() - path.stat().st_mtime < 5


_RACE = """
import errno, fcntl, os, sys, time
from pathlib import Path
if sys.argv[3] == "unsupported":  # an NFS mount without a lock daemon: flock answers ENOLCK
    def _no_locks(*_args):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = _no_locks
_pwrite = os.pwrite
def _slow_pwrite(fd, data, offset):  # a network filesystem's write: the window two drivers could both take
    time.sleep(0.5)
    return _pwrite(fd, data, offset)
os.pwrite = _slow_pwrite
from sweeper.errors import UsageError
from sweeper.record.lock import DriverLock
lock, ready, drivers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[4])
(ready / str(os.getpid())).touch()
while len(list(ready.iterdir())) < drivers:  # every driver imported: all start at once
    time.sleep(0.001)
try:
    with DriverLock(lock):
        print("held", flush=True)
        sys.stdin.read()  # held until the test has every driver's answer
except UsageError as exc:
    print("refused", exc, flush=True)
"""


@pytest.mark.parametrize("flock", ["supported", "unsupported"])
def test_of_drivers_starting_together_one_holds_the_folder(tmp_path: Path, flock: str) -> None:
    """The file is created exclusively: two drivers cannot both write it and both go on, with or without flock."""
    path = tmp_path / "sweep" / LOCK_FILE
    path.parent.mkdir()
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(path), str(ready), flock, "4"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
             for _ in range(4)]
    try:
        answers = [p.stdout.readline() for p in procs if p.stdout is not None]
    finally:
        for p in procs:
            p.communicate(timeout=60)
    assert sorted(answer.split()[0] for answer in answers) == ["held", "refused", "refused", "refused"], answers


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_the_lock_is_released_when_the_sweep_raises(tmp_path: Path, error: type[BaseException]) -> None:
    path = tmp_path / LOCK_FILE
    with pytest.raises(error):
        with DriverLock(path):
            raise error()
    assert not path.exists()
    with DriverLock(path):  # the next driver takes it at once
        assert path.exists()


def test_a_folder_the_lock_created_goes_again_when_nothing_was_written(tmp_path: Path) -> None:
    """A sweep refused before it wrote anything (an unreachable tracking server) leaves no empty folder behind."""
    folder = tmp_path / "sweeps" / "t"
    with DriverLock(folder / LOCK_FILE):
        assert folder.is_dir()
    assert not (tmp_path / "sweeps").exists()
    with DriverLock(folder / LOCK_FILE):
        (folder / "trials.jsonl").write_text("")
    assert sorted(p.name for p in folder.iterdir()) == ["trials.jsonl"]


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_search_driver_on_a_folder_in_use_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    sweep_dir = SweepDir(out)
    sweep_dir.create()
    sweep_dir.write_meta(SweepMeta())
    sweep_dir.trials.write_text("")
    sweep_dir.space.write_text("name: quickstart\n")
    with DriverLock(sweep_dir.lock):
        before = _snapshot(out)
        proc = subprocess.run(
            [sys.executable, "-m", "sweeper", "search", str(ROOT / "search_spaces" / "quickstart.yaml"), "--out",
             str(out), "--resume"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"error: --out: {out} is in use by another sweeper driver (pid {os.getpid()} on ")
        assert lines[0].endswith("holding its lock); wait for it to end")
        assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no MLflow store, no other folder


def test_search_break_lock_takes_over_a_dead_drivers_lock_before_anything_else(tmp_path: Path) -> None:
    """`sweeper search --break-lock`: the lock of a driver gone on another host is taken over with one line; the
    command then goes on as without it (here: refused, the folder holds no sweep to resume)."""
    out = tmp_path / "sweep"
    lock = out / LOCK_FILE
    _write_holder(lock, 1234, "host-a.invalid")
    proc = subprocess.run(
        [sys.executable, "-m", "sweeper", "search", str(ROOT / "search_spaces" / "quickstart.yaml"), "--out", str(out),
         "--resume", "--break-lock"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert f"{lock}: taking over the lock of a sweeper driver that is gone (pid 1234 on host-a.invalid, started " \
           "2026-12-06T01:00:00Z; --break-lock)" in proc.stderr
    assert proc.returncode == 2 and proc.stderr.strip().endswith(f"--resume: {out} holds no sweep to resume")
    assert not lock.exists()
