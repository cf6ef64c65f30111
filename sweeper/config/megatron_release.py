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


# Megatron-LM's flag for a hybrid model's layer pattern: --hybrid-override-pattern up to 0.18, deprecated in 0.19 for
# --hybrid-layer-pattern (issue 52). 0.17.1's and 0.18.2's flags list both (tests/data/megatron_lm_flags_0.17.txt,
# _0.18.txt); the old one, not yet deprecated there, stays the export's flag on them.
HYBRID_LAYER_PATTERN_FROM = Version("0.19")


def hybrid_pattern_flag(release: Version | None = None) -> str:
    """Megatron-LM's hybrid layer-pattern flag of ``release`` (default: the installed one)."""
    release = installed() if release is None else release
    return "--hybrid-layer-pattern" if release >= HYBRID_LAYER_PATTERN_FROM else "--hybrid-override-pattern"
