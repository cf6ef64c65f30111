"""`plan --json` of a large space on the cores this process may use (issue 54).

A plan's work is per layout (the rules, the estimator, the JSON text) and so is its order: the valid layouts by
their own predictions (``order_keys``), ties in the space's order, then the invalid ones in the space's order. So the
space's layouts go in blocks, round robin, to worker processes forked once the config is loaded (each inherits the
config, the calibration and the space's product: nothing is imported again); each builds its blocks' layouts
(``SpaceProduct.layouts``), judges them, predicts the valid ones through its own term table and writes their JSON
elements; this process, worker 0, merges them: the valid elements by their keys, then each block's invalid
elements, one piece of text a block. The text is byte for byte the one-process plan's (``Plan.json_text``; tests
over spaces, block sizes and worker counts). A worker that fails or dies has its share done again here, where an
error reaches the command as it would alone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import pickle
import signal
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, NoReturn, Protocol, TypeVar

import numpy as np
import orjson

from sweeper.config.schema import SweepConfig
from sweeper.estimate.calibration import Calibration
from sweeper.plan.assess import Plan, judge_space, order_keys
from sweeper.space.layout import Layout

BLOCK = 2048  # layouts: a worker's unit of work, and the invalid layouts' piece of text
MAX_WORKERS = 8  # each worker predicts the stage shapes its layouts share with the others' again
MIN_LAYOUTS = 4 * BLOCK  # fewer: one process (forking and merging would cost more than they save)
_R = TypeVar("_R")
_log = logging.getLogger("sweeper.plan")


class Layouts(Protocol):
    """A plan's layouts, built when asked for: all, or those at some places (ranges) of their order."""

    def __len__(self) -> int: ...

    def layouts(self, places: Sequence[range] | None = None) -> list[Layout]: ...


@dataclass(frozen=True)
class Listed:
    """``Layouts`` already built (a space after ``--only``)."""

    items: list[Layout]

    def __len__(self) -> int:
        return len(self.items)

    def layouts(self, places: Sequence[range] | None = None) -> list[Layout]:
        return list(self.items) if places is None else [self.items[i] for where in places for i in where]


def workers_for(count: int) -> int:
    """How many processes plan ``count`` layouts: one per core this process may run on, at most ``MAX_WORKERS``
    and one a block; one below ``MIN_LAYOUTS``, or where fork is not the platform's safe default (Linux only)."""
    if sys.platform != "linux" or count < MIN_LAYOUTS:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS, -(-count // BLOCK)))


def plan_json_text(cfg: SweepConfig, layouts: Layouts, calibration: Calibration | None,
                   workers: int | None = None, block: int = BLOCK) -> Iterator[bytes | memoryview]:
    """``Plan.json_text`` of ``layouts`` (the space's, in its order) under ``calibration``: the contract's JSON
    elements a piece at a time, comma-separated within a piece, made by ``workers`` processes (``workers_for``'s
    count when None)."""
    blocks, workers = split(len(layouts), workers, block)
    if workers <= 1:
        yield from Plan.of(*judge_space(cfg, layouts.layouts(), calibration), calibration).json_text()
        return
    shards = in_workers(lambda w: _shard(cfg, layouts, blocks, range(w, len(blocks), workers), calibration), workers,
                        _Shard.dump, _Shard.load)
    elements = [text for s in shards for text in s.valid]
    yield b",".join([elements[i] for i in merged_order(shards)])
    invalid = {b: text for s in shards for b, text in zip(s.blocks, s.invalid, strict=True)}
    for b in range(len(blocks)):
        yield invalid[b]


def merged_order(parts: Sequence[Any]) -> list[int]:
    """The plan's order of the valid layouts of ``parts`` (each with their places in the space, ``index``, and their
    ``order_keys``, ``group``, ``first``, ``second``), as indices into the parts' valid layouts one part after
    another."""
    index, group, first, second = (np.concatenate([getattr(p, name) for p in parts])
                                   for name in ("index", "group", "first", "second"))
    return np.lexsort((index, second, first, group)).tolist()


def split(count: int, workers: int | None, block: int = BLOCK) -> tuple[list[range], int]:
    """``count`` layouts' blocks of ``block``, and how many workers share them (``workers_for``'s when None, at
    most one a block); worker w takes blocks w, w + workers, ... (``range(w, len(blocks), workers)``)."""
    blocks = [range(start, min(start + block, count)) for start in range(0, count, block)]
    return blocks, min(workers_for(count) if workers is None else workers, len(blocks))


@dataclass(frozen=True)
class _Shard:
    """What a worker sends back: its valid layouts' places in the space, their keys in the plan's order and their
    JSON elements, and the text of each of its blocks' invalid elements (comma-separated, empty where none). The
    text comes back as written (``dump``, ``load``): views of the worker's file, not a pickle copied twice."""

    index: np.ndarray
    group: np.ndarray
    first: np.ndarray
    second: np.ndarray
    valid: Sequence[bytes | memoryview]
    blocks: list[int]
    invalid: Sequence[bytes | memoryview]

    def dump(self, spool: IO[bytes]) -> None:
        """Written as the header's length, the header (the arrays and every text's length, pickled), the texts."""
        lengths = [len(text) for text in (*self.valid, *self.invalid)]
        header = pickle.dumps((self.index, self.group, self.first, self.second, len(self.valid), self.blocks,
                               lengths), protocol=pickle.HIGHEST_PROTOCOL)
        spool.write(len(header).to_bytes(8, "little"))
        spool.write(header)
        for text in (*self.valid, *self.invalid):
            spool.write(text)

    @classmethod
    def load(cls, spool: IO[bytes]) -> _Shard:
        view = memoryview(mmap.mmap(spool.fileno(), 0, access=mmap.ACCESS_READ))
        size = int.from_bytes(view[:8], "little")
        index, group, first, second, valid, blocks, lengths = pickle.loads(view[8:8 + size])
        ends = list(itertools.accumulate(lengths, initial=8 + size))
        texts = [view[a:b] for a, b in itertools.pairwise(ends)]
        return cls(index, group, first, second, texts[:valid], blocks, texts[valid:])


@dataclass(frozen=True)
class PlannedShare:
    """A worker's share of the space planned: its layouts' plan (in the space's order), their places in the space,
    which are valid, and the valid ones' places (``index``) and keys in the plan's order (``merged_order``'s)."""

    plan: Plan
    places: np.ndarray
    valid: np.ndarray
    index: np.ndarray
    group: np.ndarray
    first: np.ndarray
    second: np.ndarray


def plan_share(cfg: SweepConfig, layouts: Layouts, blocks: Sequence[range], share: range,
               calibration: Calibration | None) -> PlannedShare:
    """The layouts of the blocks numbered in ``share``, built, judged and predicted."""
    plan = Plan.of(*judge_space(cfg, layouts.layouts([blocks[b] for b in share]), calibration), calibration)
    places = np.concatenate([np.arange(blocks[b].start, blocks[b].stop) for b in share])
    valid = np.array([not e.reasons for e in plan.judged], dtype=bool)
    group, first, second = (k[valid] for k in order_keys(valid, np.asarray(plan.row), plan.predictions))
    return PlannedShare(plan, places, valid, places[valid], group, first, second)


def _shard(cfg: SweepConfig, layouts: Layouts, blocks: Sequence[range], share: range,
           calibration: Calibration | None) -> _Shard:
    """One worker's share: its layouts planned (``plan_share``) and written."""
    mine = plan_share(cfg, layouts, blocks, share, calibration)
    plan, valid = mine.plan, mine.valid
    at = np.flatnonzero(valid).tolist()
    texts = [orjson.dumps(element) for start in range(0, len(at), BLOCK)
             for element in plan.json_of(at[start:start + BLOCK])]
    invalid, start = [], 0
    for b in share:
        judged = range(start, start + len(blocks[b]))
        invalid.append(orjson.dumps(plan.json_of([i for i in judged if not valid[i]]))[1:-1])
        start += len(blocks[b])
    return _Shard(mine.index, mine.group, mine.first, mine.second, texts, list(share), invalid)


def _pickled(result: object, spool: IO[bytes]) -> None:
    spool.write(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))


def _unpickled(spool: IO[bytes]) -> Any:
    spool.seek(0)
    return pickle.loads(spool.read())


def in_workers(work: Callable[[int], _R], workers: int, dump: Callable[[_R, IO[bytes]], None] = _pickled,
               load: Callable[[IO[bytes]], _R] = _unpickled) -> list[_R]:
    """``work(w)`` for w in 0..workers-1: 0 in this process, the others each in a forked process that ``dump``s its
    result in an unnamed temporary file (written while this process works; a pipe would hold the worker until this
    one reads, then copy tens of MB while nothing else runs) and says so on a pipe. One that fails or dies (its pipe
    closed without a word) is done again here."""
    children: list[tuple[int, int, IO[bytes], int]] = []  # (worker, pid, its file, its pipe's reading end)
    running: set[int] = set()  # the workers' pids not reaped nor known to be exiting
    here = [0]  # the shares this process does
    try:
        for w in range(1, workers):
            try:
                spool: IO[bytes] = tempfile.TemporaryFile()
            except OSError as exc:  # no temporary directory to write to: the rest of the shares done here
                _not_started(w, workers, exc)
                here += range(w, workers)
                break
            ready, said = os.pipe()
            with warnings.catch_warnings():
                # Python 3.12 warns on forking a process with threads. The only other thread of a plan is numpy's
                # OpenBLAS pool, which shuts down over a fork through its own pthread_atfork handler.
                warnings.filterwarnings("ignore", r".*use of fork\(\) may lead to deadlocks", DeprecationWarning)
                try:
                    pid = os.fork()
                except OSError as exc:  # out of processes or memory: the rest of the shares done here
                    _not_started(w, workers, exc)
                    spool.close()
                    os.close(ready)
                    os.close(said)
                    here += range(w, workers)
                    break
            if pid == 0:
                os.close(ready)
                _serve(work, w, spool, said, dump)
            os.close(said)
            children.append((w, pid, spool, ready))
            running.add(pid)
        results = [work(w) for w in here]
        for w, pid, spool, ready in children:
            if os.read(ready, 1):  # its result is written; it exits by itself
                running.discard(pid)
                results.append(load(spool))
                continue
            running.discard(pid)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            # On stderr (stdout may be the JSON): a worker that fails here is a bug of sweeper's or a lack of memory
            _log.warning("plan: worker %d of %d %s; its share is done in this process", w, workers,
                         f"exited with {code}" if code >= 0 else f"was killed by signal {-code}")
            results.append(work(w))
        return results
    finally:  # done, or this process failed: every worker stopped and reaped, its file and pipe closed
        for _, pid, spool, ready in children:
            if pid in running:
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):  # one whose failure was reaped above
                os.waitpid(pid, 0)
            spool.close()
            os.close(ready)


def _not_started(w: int, workers: int, exc: OSError) -> None:
    _log.warning("plan: worker %d of %d not started (%s); its share and the later ones are done in this process", w,
                 workers, exc)


def _serve(work: Callable[[int], _R], w: int, spool: IO[bytes], said: int,
           dump: Callable[[_R, IO[bytes]], None]) -> NoReturn:
    """A forked worker: ``work(w)`` dumped into ``spool``, a byte on the pipe ``said``, then out without running this
    process's exit handlers or flushing the stdout it inherited. An error exits non-zero without the byte, so the
    first process does the share again itself."""
    code = 1
    try:
        dump(work(w), spool)
        spool.flush()
        os.write(said, b"1")
        code = 0
    finally:
        os._exit(code)
