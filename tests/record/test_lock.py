"""One driver per sweep folder (issue 43): a second driver is refused with the holder named and writes nothing; a
stale lock of a dead driver on this host is taken over; a lock naming another host is refused; the lock goes with
the driver however it exits."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sweeper.errors import UsageError
from sweeper.record.lock import LOCK_FILE, DriverLock
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
            f"{socket.gethostname()}, started {record['started_at']}); wait for it, or delete {path} if that "
            "driver is gone")
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
                    f"{socket.gethostname()}, started 2026-12-06T01:00:00Z)"]
    assert not path.exists()


def test_a_lock_naming_this_process_that_it_does_not_hold_is_stale(tmp_path: Path) -> None:
    """A container restarted under the same host name numbers its pids alike: the new driver may get the old pid."""
    path = tmp_path / LOCK_FILE
    _write_holder(path, os.getpid(), socket.gethostname())
    said: list[str] = []
    with DriverLock(path, say=said.append):
        pass
    assert len(said) == 1


def test_a_lock_naming_another_host_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """On a shared filesystem flock may not reach the other host, and its pids tell nothing: only a person knows."""
    path = tmp_path / LOCK_FILE
    text = _write_holder(path, 1234, "host-a.invalid")
    with pytest.raises(UsageError, match=r"in use by another sweeper driver \(pid 1234 on host-a.invalid, started "
                       r"2026-12-06T01:00:00Z\); wait for it, or delete .*driver.lock if that driver is gone"):
        DriverLock(path).acquire()
    assert path.read_text() == text


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
        assert f"delete {sweep_dir.lock} if that driver is gone" in lines[0]
        assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no MLflow store, no other folder
