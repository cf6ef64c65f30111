"""Hang forensics: a process armed with a stack dump writes it when still running at the dump time, and the runner's
summary names where each rank was. The dumps here are real (faulthandler in this process); the torch.distributed
case is a real hung trial in test_trial_runner.py."""

from __future__ import annotations

import time
from pathlib import Path

from sweeper.trial import stacks


def _wait_in_here(seconds: float) -> None:
    time.sleep(seconds)


def test_a_rank_still_running_at_the_dump_time_leaves_its_stack(tmp_path: Path) -> None:
    with stacks.armed(str(tmp_path), 3, time.time() + 0.3):
        _wait_in_here(1.0)
    dump = tmp_path / "stacks" / "rank_003.txt"
    frames = stacks.backend_stack(dump.read_text())
    assert frames[0][2] == "_wait_in_here" and frames[0][0].endswith("test_stacks.py")
    assert frames[1][2] == "test_a_rank_still_running_at_the_dump_time_leaves_its_stack"
    assert stacks.where(frames).startswith("in _wait_in_here (tests/trial/test_stacks.py:")
    summary = stacks.blocked_in(tmp_path)
    assert summary is not None and summary.startswith("rank 3 in _wait_in_here (tests/trial/test_stacks.py:")


def test_a_rank_that_finishes_in_time_leaves_nothing(tmp_path: Path) -> None:
    with stacks.armed(str(tmp_path), 0, time.time() + 5.0):
        pass
    time.sleep(0.1)
    assert not list((tmp_path / "stacks").glob("*.txt")) and stacks.blocked_in(tmp_path) is None


def test_a_collective_is_named_with_its_caller_and_ranks_in_one_place_are_grouped(tmp_path: Path) -> None:
    # Parser test data in faulthandler's format (what a rank blocked in all_reduce writes).
    torch_dir = "/venv/lib/python3.11/site-packages/torch/distributed"
    blocked = (
        "backend thread 0x00007f0000000001\n"
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        f'  File "{torch_dir}/distributed_c10d.py", line 2806 in all_reduce\n'
        f'  File "{torch_dir}/c10d_logger.py", line 81 in wrapper\n'
        '  File "/venv/lib/python3.11/site-packages/megatron/core/distributed/finalize_model_grads.py", line 300 '
        "in finalize_model_grads\n"
        '  File "/work/sweeper/backends/megatron/steps.py", line 90 in train_step\n'
    )
    folder = tmp_path / "stacks"
    folder.mkdir()
    for rank in (0, 1, 3):
        (folder / f"rank_{rank:03d}.txt").write_text(blocked)
    (folder / "rank_002.txt").write_text(
        "backend thread 0x00007f0000000009\nCurrent thread 0x00007f0000000009 (most recent call first):\n"
        '  File "/work/sweeper/backends/megatron/smoke.py", line 280 in _inject\n')
    assert stacks.where(stacks.backend_stack(blocked)) == (
        "blocked in torch.distributed all_reduce, called from finalize_model_grads "
        "(megatron/core/distributed/finalize_model_grads.py:300)")
    summary = stacks.blocked_in(tmp_path)
    assert summary is not None
    assert summary.startswith("ranks 0,1,3 blocked in torch.distributed all_reduce, called from finalize_model_grads")
    assert "; rank 2 in _inject (sweeper/backends/megatron/smoke.py:280)" in summary
