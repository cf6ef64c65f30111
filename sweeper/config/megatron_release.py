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


# From 0.18 (checked on 0.18.2 and 0.19.2; 0.17 not checked) a layer's graphed parts are cuda_graph_modules,
# full-iteration graphs cuda_graph_impl="full_iteration"; cuda_graph_scope is deprecated (migrated with a warning).
GRAPH_MODULES_FROM = Version("0.18")


def graph_modules() -> bool:
    """Whether the installed release names CUDA graphs' parts cuda_graph_modules (Layout.cuda_graph_fields)."""
    return installed() >= GRAPH_MODULES_FROM
