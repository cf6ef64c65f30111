"""Peak memory of a rank, and the CPU backend's simulated GPU memory limit ("OOM" on a host without GPUs).

On a GPU the figure is torch's peak reserved device memory. On the CPU it is this process's peak resident set
(host memory). A ``MemoryWatchdog`` samples the resident set in a thread; when it exceeds the simulated limit
it raises ``SimulatedOOMError`` in the rank's smoke-run thread (delivered at the next Python bytecode, like a real
allocation failure), so the rank stops where it is and still returns its report. If the smoke-run thread cannot
be interrupted (blocked inside a C call such as a collective) within ``grace_s``, the process exits with
code 12 after logging the figure: the rank must not keep running past its memory.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import resource
import threading
from pathlib import Path

import psutil
import torch

from sweeper.backends.megatron.failures import SimulatedOOMError
from sweeper.config.units import GIB

_log = logging.getLogger(__name__)


def peak_memory_bytes(cuda: bool) -> int:
    if cuda:
        return int(torch.cuda.max_memory_reserved())
    # ru_maxrss is in KiB on Linux: the process's peak resident set since it started.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MemoryWatchdog:
    """Samples RSS every ``interval_s``; past ``limit_bytes`` interrupts ``target`` thread with SimulatedOOMError."""

    def __init__(self, limit_bytes: int, interval_s: float = 0.02, grace_s: float = 30.0) -> None:
        self.limit_bytes = limit_bytes
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.exceeded_bytes: int | None = None
        # The thread running the smoke run (a Ray actor may call it off the process's smoke-run thread).
        self._target = threading.get_ident()
        self._stop = threading.Event()
        self._handled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sweeper-memory-watchdog", daemon=True)
        self._process = psutil.Process()

    def start(self) -> MemoryWatchdog:
        """Arm the watchdog. A rank already past the limit fails here, in the calling thread: the sampling thread's
        first look could otherwise come after the rank entered a blocking C call (the rendezvous), which an
        asynchronous raise cannot interrupt, and the rank would exit instead of reporting."""
        if self._over_limit():
            raise self.error()
        self._thread.start()
        return self

    def __enter__(self) -> MemoryWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Disarm (the report is being written): no exception and no exit from here on."""
        self._handled.set()
        self._stop.set()

    def error(self) -> SimulatedOOMError:
        used = (self.exceeded_bytes or 0) / GIB
        return SimulatedOOMError(
            f"resident host memory {used:.2f} GiB exceeded the simulated GPU memory of "
            f"{self.limit_bytes / GIB:.2f} GiB"
        )

    def check(self) -> None:
        """Safe point for the smoke-run thread: raise if the limit was exceeded (in case the async raise was lost)."""
        if self.exceeded_bytes is not None:
            raise self.error()

    def _over_limit(self) -> bool:
        rss = self._process.memory_info().rss
        if rss <= self.limit_bytes:
            return False
        self.exceeded_bytes = rss
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._over_limit():
                continue
            _log.error("memory watchdog: %s", self.error())
            # Raise in the smoke-run thread at its next bytecode: the rank stops now, run_rank's handler reports it.
            if not self._handled.is_set():
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._target), ctypes.py_object(SimulatedOOMError)
                )
            if not self._handled.wait(self.grace_s):
                _log.error("memory watchdog: smoke-run thread did not stop within %.0f s; exiting", self.grace_s)
                logging.shutdown()
                os._exit(12)
            return


def non_torch_device_bytes() -> int:
    """The current CUDA device's used memory that torch's allocator does not hold (context, NCCL, workspaces):
    one rank per GPU, so the device's used memory is this rank's."""
    free, total = torch.cuda.mem_get_info()
    return max(0, int(total - free - torch.cuda.memory_reserved()))


class StepsPeak:
    """The training steps' peak memory, and apart from it the rank's peak before the steps (build, reference load,
    equivalence gate), created when the steps start.

    Creating it reads the peak so far (``before_bytes``) and resets the peak statistics, so build and the gate
    (with FP8 parameters the reference load dequantizes every weight at once) stay out of the steps' figure. The
    checkpoint phases inside the steps are kept out the same way: the peak is read before each mid-run save and
    reset after it. On a GPU the figures are the allocator's peak reserved memory; on the CPU the process's peak
    resident set, the kernel's high-water mark (``VmHWM``), reset through ``/proc/self/clear_refs``. Where the kernel
    refuses the reset, the CPU figure stays the process's peak since it started and ``resettable`` is False."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.before_bytes = self._read()
        self._before = 0
        self.resettable = self._reset()

    def _read(self) -> int:
        return int(torch.cuda.max_memory_reserved()) if self.cuda else resident_high_water_bytes()

    def _reset(self) -> bool:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return True
        return reset_resident_high_water()

    def pause(self) -> None:
        self._before = max(self._before, self._read())

    def resume(self) -> None:
        self._reset()

    def peak_bytes(self) -> int:
        self.pause()
        return self._before


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def resident_high_water_bytes() -> int:
    """This process's peak resident set: the kernel's ``VmHWM`` (which ``/proc/self/clear_refs`` resets; getrusage's
    ru_maxrss also keeps the figure of every thread that exited, so it cannot be reset), else ru_maxrss."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        match = None
    return int(match.group(1)) * 1024 if match else peak_memory_bytes(False)


def reset_resident_high_water() -> bool:
    """Reset this process's peak resident set to its current resident set (Linux >= 4.0: writing 5 to
    ``/proc/self/clear_refs``); False where the kernel does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class PeakResident:
    """This process's peak resident set while the block runs, sampled every ``interval_s`` (and at both ends).

    The save of a sharded checkpoint stages every shard in host memory (device-to-host copies on a GPU); what a
    node must hold is its ranks' resident sets at that moment, so the figure is the whole process's, not the
    growth."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sweeper-checkpoint-rss", daemon=True)

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakResident:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def host_memory_bytes(limit_gib: float | None) -> int:
    """The node's host memory: the configured figure, else what this node has."""
    return int(limit_gib * GIB) if limit_gib is not None else int(psutil.virtual_memory().total)


class PhasePeak:
    """Peak memory of one phase of the smoke run, as the trial's peak is measured: on a GPU torch's peak reserved
    memory since the phase began (the allocator's statistics are reset), on the CPU the peak resident set."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.peak_bytes = 0
        self._resident = PeakResident()

    def __enter__(self) -> PhasePeak:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self._resident.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.peak_bytes = int(torch.cuda.max_memory_reserved())
        else:
            self._resident.__exit__()
            self.peak_bytes = self._resident.peak_bytes
