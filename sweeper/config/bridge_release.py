"""The Megatron-Bridge release sweeper's Bridge export and ``model: {hf: DIR}`` import are written for: the installed
one (read from its package metadata, megatron is not imported), else the one paired with the installed megatron-core
release. What differs between the Bridge releases sweeper supports (0.3.1 to 0.6.x) for what it emits or calls is
here, once, naming the release; everything else sweeper uses was read the same in each (docs/support-matrix.md).

The pairing is Bridge's own ``3rdparty/Megatron-LM`` submodule pin (from 0.4 Bridge's metadata asks for
``megatron-core[dev,mlm]`` with no version; 0.3.1 asks for ``<0.17``): v0.3.1 pins core_v0.16.1, v0.4.0 to v0.4.2
core_r0.17.0 (0.17.1 at v0.4.2), v0.5.0 and v0.5.1 core_r0.18.0 (0.18.0, 0.18.2), v0.6.0 a main commit that reports
0.19.0. Bridge 0.4 on imports ``megatron.training.config``, which megatron-core ships from 0.17; 0.5 its container
and instantiate_utils (0.18), 0.6 ``megatron.training.models.gpt`` (0.19).
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

from sweeper.config import megatron_release

# megatron-core minor release -> the Bridge release that pins it (the newest of that line on the registry).
PAIRED: dict[str, Version] = {
    "0.16": Version("0.3.1"),
    "0.17": Version("0.4.2"),
    "0.18": Version("0.5.1"),
    "0.19": Version("0.6.2"),
}

# From 0.4 MixedPrecisionConfig has fp4_param / fp4_param_gather, and bf16_with_nvfp4_mixed turns
# fp4_param_gather on (NVFP4 weights stored and gathered in FP4); 0.3.1's recipe keeps BF16 weights, as sweeper's
# trial, estimate and Megatron-LM export do.
FP4_PARAMS_FROM = Version("0.4")
# From 0.6 GPTModelProvider.provide() (and ConfigContainer.validate) refuse cuda_graph_impl="local" other than
# full-iteration graphs (utils/cuda_graph.py validate_cuda_graph_configuration): per-layer local graphs are
# Transformer Engine's there.
LOCAL_LAYER_GRAPHS_REFUSED_FROM = Version("0.6")


@cache
def installed() -> Version | None:
    """The installed Megatron-Bridge release, None when it is not installed."""
    try:
        return Version(version("megatron-bridge"))
    except PackageNotFoundError:
        return None


def paired(core: Version) -> Version | None:
    """The Bridge release paired with megatron-core ``core``; None for a core release no Bridge release pins."""
    return PAIRED.get(f"{core.major}.{core.minor}")


def target() -> Version:
    """The Bridge release the export and the import follow: the installed one, else the installed megatron-core's
    pair (the newest pairing past the last one sweeper knows)."""
    found = installed()
    return found if found is not None else _for_installed_core()


def _for_installed_core() -> Version:
    """The Bridge release paired with the installed megatron-core, or the newest pairing past the last one known."""
    return paired(megatron_release.installed()) or max(PAIRED.values())


def describe() -> str:
    """``0.6.2 (installed)`` or ``0.3.1 (paired with megatron-core 0.16.1; not installed here)``."""
    release, core = target(), megatron_release.installed()
    if installed() == release:
        return f"{release} (installed)"
    if paired(core) == release:
        return f"{release} (paired with megatron-core {core}; not installed here)"
    return str(release)


def install_hint() -> str:
    """What ``pip install -e '.[bridge]'`` brings for the installed megatron-core (pyproject's bridge extra)."""
    return f"megatron-bridge {_for_installed_core()} with Transformer Engine"


def fp4_params(release: Version) -> bool:
    """Whether ``release``'s MixedPrecisionConfig has fp4_param_gather (and its NVFP4 recipe turns it on)."""
    return release >= FP4_PARAMS_FROM


def refuses_local_layer_graphs(release: Version) -> bool:
    """Whether ``release`` refuses cuda_graph_impl="local" graphs of single layers (full-iteration ones pass)."""
    return release >= LOCAL_LAYER_GRAPHS_REFUSED_FROM
