"""The megatron-core trial backend: the only package in sweeper that imports megatron.

``run_rank(request) -> RankReport`` runs one rank of a smoke trial. Importing this package is cheap: megatron
is imported only when a rank actually runs (and only after the request was checked for what this backend
supports), or when a warm rank process calls ``warm_up``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

from sweeper.backends.megatron.smoke import run_rank

# What a rank's smoke run imports lazily (smoke.py), imported ahead by ``warm_up``.
_WARM_MODULES = (
    "megatron.core.parallel_state",
    "sweeper.backends.megatron.build",
    "sweeper.backends.megatron.steps",
    "sweeper.backends.megatron.equivalence",
    "sweeper.backends.megatron.replicas",
    "sweeper.backends.megatron.checkpoint",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)


def warm_up(gpu: bool) -> None:
    """Import megatron-core and the model builders now, for a warm rank process (sweeper/trial/pool.py) whose
    forked children then start at once. CUDA must stay uninitialised here (a forked child cannot use a CUDA
    context its parent created). torch's CUDA check goes through NVML; where NVML does not answer torch falls
    back to cudaGetDeviceCount, which initialises CUDA without ``torch.cuda.is_initialized()`` saying so, so on a
    GPU rank (``gpu``) a CUDA build of torch without NVML refuses to warm up. A CPU rank (a simulated cluster,
    every GPU hidden from it) never asks CUDA anything, so any torch build warms up. Megatron's layer specs
    import Transformer Engine here too; the check after the imports catches any import that initialised CUDA."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    if gpu and torch.backends.cuda.is_built() and not _nvml_answers():
        raise RuntimeError("NVML does not answer on this node, so torch's CUDA check would initialise CUDA in the "
                           "warm rank process and its forked ranks could not use the GPU; set cluster.warm_ranks: "
                           "false")
    from sweeper.backends.megatron.cpu import compat

    compat.install()
    for name in _WARM_MODULES:
        importlib.import_module(name)
    if torch.cuda.is_initialized():
        raise RuntimeError("warming up initialised CUDA, so its forked ranks could not use the GPU; set "
                           "cluster.warm_ranks: false")


def _nvml_answers() -> bool:
    """Whether NVML answers torch's device count on this node, asked in a child interpreter: asked here, NVML would
    stay initialised in the warm process, and every forked rank would inherit that state with its descriptors
    (a candidate cause of the forked GPU ranks' nvmlInit failure on the first GPU run)."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda._device_count_nvml() >= 0 else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"},
                              capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


__all__ = ["run_rank", "warm_up"]
