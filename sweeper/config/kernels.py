"""Which optional GPU kernel packages the ranks' nodes have: Transformer Engine, mamba_ssm, causal-conv1d, DeepEP.

What a sweep can run on a GPU cluster is decided by what its GPU nodes have, not the driver: a KubeRay head (a CPU
pod) or a login node has none of them, and asking it marked FP8, MLA, hybrid Mamba, CUDA graphs and the flex
dispatcher unsupported for the whole sweep (issue 44). ``Kernels.here()`` looks on the machine it runs on (package
finders only: nothing is imported, no CUDA call); sweeper.cluster.node_kernels asks every GPU node and keeps what
all of them have, since a trial's ranks may land on any of them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Kernels:
    transformer_engine: bool = False
    mamba_ssm: bool = False
    causal_conv1d: bool = False
    deep_ep: bool = False

    @classmethod
    def here(cls) -> Kernels:
        """The packages this machine can find (importlib's finders: no import, so no CUDA initialisation)."""
        return cls(**{f.name: _findable(f.name) for f in fields(cls)})

    @classmethod
    def on_every(cls, nodes: Iterable[Kernels]) -> Kernels:
        """What every one of ``nodes`` has (none: nothing)."""
        found = list(nodes)
        if not found:
            return cls()
        return cls(**{f.name: all(getattr(k, f.name) for k in found) for f in fields(cls)})

    def names(self) -> list[str]:
        return [f.name for f in fields(self)]

    def present(self) -> list[str]:
        return [name for name in self.names() if getattr(self, name)]

    def missing(self) -> list[str]:
        return [name for name in self.names() if not getattr(self, name)]


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
