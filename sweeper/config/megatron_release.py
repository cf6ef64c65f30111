"""The installed megatron-core release, read from its package metadata (megatron is not imported): the layout rules
that refuse an upstream defect and the trial's version-dependent calls (backends/megatron/releases.py) follow it.
The driver's release stands for the cluster's: sweeper runs on the nodes from the same environment."""

from __future__ import annotations

from functools import cache
from importlib.metadata import version

from packaging.version import Version


@cache
def installed() -> Version:
    """The installed megatron-core release."""
    return Version(version("megatron-core"))
