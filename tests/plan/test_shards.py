"""`plan --json` on several processes (sweeper/plan/shards.py): the same text as one process's, whatever the
workers, the blocks, the calibration; a worker that fails or dies is done again; a failure here leaves no worker."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest

from sweeper.cli import main
from sweeper.config.load import load_config
from sweeper.estimate import Calibration
from sweeper.plan import shards
from sweeper.plan.assess import Plan, judge_space, space_layouts
from sweeper.plan.space import SpaceProduct
from tests.workers import shares_made_here

ROOT = Path(__file__).resolve().parents[2]
WIDE = ROOT / "benchmarks" / "spaces" / "nemotron_wide.yaml"  # 11,520 layouts, 2,040 valid, MoE + Mamba
CALIBRATED = Calibration(activation_factor=1.2, state_factor=0.9, overhead_gib=1.0, step_time_factor=1.1)


def _text(pieces: Any) -> bytes:
    return b",".join(piece for piece in pieces if piece)


@pytest.fixture(scope="module")
def wide() -> Any:
    return load_config(WIDE)


@pytest.fixture(scope="module")
def one_process(wide: Any) -> dict[int, bytes]:
    """Plan.json_text's text of the wide space, uncalibrated (key 0) and calibrated (key 1)."""
    return {k: _text(Plan.build(wide, calibration=c).json_text()) for k, c in enumerate((None, CALIBRATED))}


@pytest.mark.parametrize(("workers", "block"), [(2, 97), (3, 1000), (2, 4096), (7, 2048)])
@pytest.mark.parametrize("calibrated", [0, 1])
def test_the_workers_text_is_one_processs(wide: Any, one_process: dict[int, bytes], workers: int, block: int,
                                          calibrated: int, monkeypatch: pytest.MonkeyPatch) -> None:
    calibration = CALIBRATED if calibrated else None
    made_here = shares_made_here(monkeypatch, shards, "_shard")
    text = _text(shards.plan_json_text(wide, SpaceProduct(wide), calibration, workers=workers, block=block))
    assert made_here == [0]  # every other worker's share came back from its process
    assert text == one_process[calibrated]
    assert len(orjson.loads(b"[" + text + b"]")) == 11520


def test_a_listed_space_after_only_goes_to_workers_too(wide: Any) -> None:
    only = {"precision": "fp8"}
    listed = shards.Listed(space_layouts(wide, only))
    assert 4000 < len(listed) < 11520
    assert _text(shards.plan_json_text(wide, listed, None, workers=2, block=500)) == _text(
        Plan.build(wide, only).json_text())


def test_a_space_smaller_than_a_block_or_empty_stays_in_one_process(wide: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    layouts = shards.Listed(space_layouts(wide)[:50])
    forks: list[int] = []
    real_fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or real_fork())
    assert _text(shards.plan_json_text(wide, layouts, None, workers=4, block=2048)) == _text(
        Plan.of(*judge_space(wide, layouts.items, None), None).json_text())
    assert not forks
    assert _text(shards.plan_json_text(wide, shards.Listed([]), None, workers=4)) == b""


def test_workers_for_a_small_space_is_one() -> None:
    assert shards.workers_for(shards.MIN_LAYOUTS - 1) == 1
    assert 1 <= shards.workers_for(10**6) <= shards.MAX_WORKERS


def _failing_in_workers(how: str, parent: int) -> Any:
    """``shards._shard`` failing in every forked worker (a unit test of the fault path: the work itself is real)."""
    real = shards._shard

    def shard(*args: Any) -> Any:
        if os.getpid() != parent:
            if how == "raise":
                raise RuntimeError("a worker's bug")
            if how == "exit":
                os._exit(0)  # exits "cleanly" without a result
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)

    return shard


@pytest.mark.parametrize("how", ["raise", "exit", "kill"])
def test_a_worker_that_fails_or_dies_is_done_again_here(wide: Any, one_process: dict[int, bytes], how: str,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(shards, "_shard", _failing_in_workers(how, os.getpid()))
    with caplog.at_level("WARNING", logger="sweeper.plan"):
        assert _text(shards.plan_json_text(wide, SpaceProduct(wide), None, workers=3, block=1000)) == one_process[0]
    said = {"raise": "exited with 1", "exit": "exited with 0", "kill": "was killed by signal 9"}[how]
    assert [r.getMessage() for r in caplog.records] == [
        f"plan: worker {w} of 3 {said}; its share is done in this process" for w in (1, 2)]


@pytest.mark.parametrize("what", ["temporary file", "fork"])
def test_without_a_temporary_file_or_a_process_the_plan_is_made_here(
        what: str, wide: Any, one_process: dict[int, bytes], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import tempfile

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device") if what == "temporary file" else BlockingIOError(
            11, "Resource temporarily unavailable")

    monkeypatch.setattr(tempfile if what == "temporary file" else os, "TemporaryFile" if what == "temporary file"
                        else "fork", refused)
    with caplog.at_level("WARNING", logger="sweeper.plan"):
        assert _text(shards.plan_json_text(wide, SpaceProduct(wide), None, workers=3, block=1000)) == one_process[0]
    assert len(caplog.records) == 1 and "this process" in caplog.records[0].getMessage()


def test_a_failure_here_stops_and_reaps_every_worker(wide: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    parent, forked = os.getpid(), []
    real_fork = os.fork

    def fork() -> int:
        pid = real_fork()
        if pid:
            forked.append(pid)
        return pid

    def shard(*args: Any) -> Any:
        if os.getpid() == parent:
            raise RuntimeError("this process's bug")
        return real_shard(*args)

    real_shard = shards._shard
    monkeypatch.setattr(os, "fork", fork)
    monkeypatch.setattr(shards, "_shard", shard)
    with pytest.raises(RuntimeError, match="this process's bug"):
        list(shards.plan_json_text(wide, SpaceProduct(wide), None, workers=3, block=1000))
    assert len(forked) == 2
    for pid in forked:  # reaped: no longer this process's child
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_plan_json_of_a_large_space_is_written_by_workers_as_one_process_writes_it(
        one_process: dict[int, bytes], monkeypatch: pytest.MonkeyPatch,
        capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    monkeypatch.setenv("SWEEPER_CACHE", str(ROOT / "no-such-calibration.json"))  # uncalibrated
    monkeypatch.setattr(shards, "workers_for", lambda count: 2)  # whatever this machine's cores
    forked: list[int] = []
    real_fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forked.append(1) or real_fork())
    assert main(["plan", str(WIDE), "--json"]) == 0
    assert capsysbinary.readouterr().out == b"[" + one_process[0] + b"]\n"
    assert forked == [1]


def test_only_the_process_own_plan_command_leaves_its_memos_out_of_the_exit_collection(
        monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    import gc

    frozen: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))  # recorded, not done: this is pytest's process
    monkeypatch.setattr("sys.argv", ["sweeper", "plan", "quickstart", "--json"])
    assert main() == 0  # as `sweeper plan ...` runs it: the process ends when main returns
    assert frozen == [1]
    assert main(["plan", "quickstart", "--json"]) == 0  # called by a program that goes on
    assert main(["plan", "quickstart", "--only", "tp=3"]) == 2
    assert frozen == [1]
    capsysbinary.readouterr()
