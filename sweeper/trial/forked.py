"""One trial's rank as a child process forked from a warm rank process (no Ray in here; ``trial.pool`` uses it).

The warm parent has imported the backend (megatron-core, torch) once; each trial forks a fresh child that sets the
trial's environment, runs the backend and sends its report back. The child is a new process every time: nothing a
trial leaves behind (torch.distributed and Megatron's global state, the allocator's high-water mark, a crash)
reaches the next one, and a rank that crashed, hung or was killed is never reused.

The child keeps only its two pipes, stdio and the NVIDIA driver's device files (the parent's other descriptors, Ray's
sockets among them, are closed),
never returns into the parent's code (it always ends with ``os._exit``), and freezes the objects it inherited so
the garbage collector never finalises the parent's Ray objects in it. It dies with its parent: it is sent SIGKILL
when the forking thread's process exits (``PR_SET_PDEATHSIG``), and exits when its request pipe closes.

Messages, child to parent: ``("checks", TrialChecks)`` answering a request, and unasked whenever the rank has
proven more (checked every ``PUSH_EVERY_S``), ``("report", value)`` once. Parent to child: ``"checks"`` (what has
the rank proven so far?). A child too busy to answer in time (two loaded cores, a rank spinning in a collective)
has still told its parent what it had proven.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from typing import Any

from sweeper.record.schema import TrialChecks

_PR_SET_PDEATHSIG = 1
PUSH_EVERY_S = 0.25  # how often the child looks whether its rank has proven more since it last said


@dataclass(frozen=True)
class RankDied:
    """The rank's process ended without a report (crashed, exited, was killed)."""

    reason: str  # one line, e.g. "process 4242 exited with code 17 without a report"


class ForkedRank:
    """A running child: ``wait`` for its report, ask its ``checks``, ``kill`` it."""

    def __init__(self, run: Callable[[], Any], checks: Callable[[], TrialChecks], env: dict[str, str]) -> None:
        reports_r, reports_w = Pipe(duplex=False)
        requests_r, requests_w = Pipe(duplex=False)
        self._checks = TrialChecks()
        self._checks_ready = threading.Event()
        self._send_lock = threading.Lock()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(run, checks, env, reports_w, requests_r, keep=(reports_w.fileno(), requests_r.fileno()))
        self.pid = pid
        reports_w.close()
        requests_r.close()
        self._reports = reports_r
        self._requests = requests_w
        self._status: int | None = None
        self._report: Any = None
        self._reader = threading.Thread(target=self._read, name=f"sweeper-rank-{pid}", daemon=True)
        self._reader.start()

    def wait(self) -> Any:
        """The child's report, or ``RankDied`` when it ended without one."""
        self._reader.join()
        status = self._reap()
        self._close()
        if self._report is not None:
            return self._report
        return RankDied(f"process {self.pid} {_describe_status(status)}")

    def _read(self) -> None:
        while self._report is None:
            try:
                kind, value = self._reports.recv()
            except (EOFError, OSError):
                return
            if kind == "checks":
                self._checks = value
                self._checks_ready.set()
            else:
                self._report = value

    @property
    def said(self) -> TrialChecks:
        """What the child last said it had proven, asked or not."""
        return self._checks

    def checks(self, timeout_s: float) -> TrialChecks:
        """What the running child has proven: its answer, or, when it did not answer in time, what it last said
        unasked (nothing proven: it has said nothing yet)."""
        self._checks_ready.clear()
        try:
            with self._send_lock:
                self._requests.send("checks")
        except (OSError, ValueError):
            return self._checks
        self._checks_ready.wait(timeout_s)
        return self._checks

    def kill(self) -> None:
        """SIGKILL the child (``wait`` then returns RankDied). Safe to call from another thread, and twice."""
        if self._status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _reap(self) -> int:
        if self._status is None:
            _, self._status = os.waitpid(self.pid, 0)
        return self._status

    def _close(self) -> None:
        for conn in (self._reports, self._requests):
            try:
                conn.close()
            except OSError:
                pass


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"was killed by {signal.Signals(sig).name}"
        except ValueError:  # a real-time signal without a name
            return f"was killed by signal {sig}"
    return f"exited with code {os.WEXITSTATUS(status)} without a report"


def _child(
    run: Callable[[], Any],
    checks: Callable[[], TrialChecks],
    env: dict[str, str],
    reports: Connection,
    requests: Connection,
    keep: tuple[int, ...],
) -> None:
    code = 0
    try:
        gc.freeze()  # inherited objects (the parent's Ray handles among them) are never collected here
        parent = os.getppid()
        _die_with_parent(parent)
        _close_inherited_fds(keep, close_device_files=env.get(CLOSE_DEVICE_FILES_ENV) == "1")
        os.environ.clear()
        os.environ.update(env)
        lock = threading.Lock()
        threading.Thread(target=_answer_requests, args=(requests, reports, checks, lock), daemon=True).start()
        report = run()
        with lock:
            reports.send(("report", report))
    except BaseException:  # noqa: BLE001 - the parent reports RankDied with this exit code
        code = 70
    finally:
        os._exit(code)


def _answer_requests(requests: Connection, reports: Connection, checks: Callable[[], TrialChecks],
                     lock: threading.Lock) -> None:
    said = TrialChecks()
    while True:
        try:
            asked = requests.poll(PUSH_EVERY_S) and requests.recv() is not None
        except (EOFError, OSError):  # the parent is gone: so is this rank
            os._exit(71)
        now = checks()
        if asked or now != said:
            with lock:
                reports.send(("checks", now))
            said = now


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the request pipe's EOF still ends the child
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(71)


# Descriptors a forked rank keeps besides its pipes: the NVIDIA driver's device files. Closed under a driver
# library (NVML, CUDA) that the parent had initialised, they leave it believing it still holds them.
_DEVICE_FILES = ("/dev/nvidia",)
# Diagnosis only (scripts/gpu_check.sh's bf16-dense-warm-closefds): "1" in the warm rank's environment closes the
# device files too, as forked ranks did when the first GPU run's NCCL failed in nvmlInit.
CLOSE_DEVICE_FILES_ENV = "SWEEPER_FORK_CLOSE_DEVICE_FILES"


def _close_inherited_fds(keep: tuple[int, ...], close_device_files: bool = False) -> None:
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2 and fd not in keep and (close_device_files or not _is_device_file(fd)):
            try:
                os.close(fd)
            except OSError:
                pass


def _is_device_file(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(_DEVICE_FILES)
    except OSError:
        return False
