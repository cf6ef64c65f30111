"""For the tests of plan's workers (sweeper/plan/shards.py): which shares this process made itself."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pytest


def shares_made_here(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> list[int]:
    """The first block of each share that ``module.name`` (a worker's function: its fourth argument the share's
    range of blocks) made in this process from now on; a forked worker's are not listed."""
    here, real = os.getpid(), getattr(module, name)
    made: list[int] = []

    def work(*args: Any) -> Any:
        if os.getpid() == here:
            made.append(args[3].start)
        return real(*args)

    monkeypatch.setattr(module, name, work)
    return made
