"""What the GPU nodes have decides what a GPU sweep can run (sweeper/config/kernels.py, sweeper/cluster/node_kernels.py):
the pure parts; the probe on a cluster's nodes runs in tests/cluster/test_cluster.py."""

from __future__ import annotations

from sweeper.cluster.node_kernels import import_failure
from sweeper.config.kernels import Kernels


def test_what_every_node_has() -> None:
    a = Kernels(transformer_engine=True, mamba_ssm=True, deep_ep=True)
    b = Kernels(transformer_engine=True, mamba_ssm=False, deep_ep=True)
    assert Kernels.on_every([a, b]) == Kernels(transformer_engine=True, deep_ep=True)
    assert Kernels.on_every([]) == Kernels()
    assert Kernels.on_every([a, b]).missing() == ["mamba_ssm", "causal_conv1d"]


def test_this_cpu_machine_has_no_gpu_kernels_and_says_why_they_do_not_import() -> None:
    assert Kernels.here() == Kernels()
    assert import_failure("transformer_engine") == "ModuleNotFoundError: No module named 'transformer_engine'"
