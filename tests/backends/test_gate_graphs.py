"""The equivalence gate records no local CUDA graph (issue 44 item 3): its micro-batch-1 forward/backward would be
the shape megatron-core captures, and the steps at another micro-batch size would hit the graph-shape asserts.

The dispatch is megatron-core's own (MegatronModule.__call__ -> ``_should_call_local_cudagraph``); the manager is a
stand-in, since a real CudaGraphManager needs CUDA (its __init__ allocates a graph pool)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
from megatron.core.transformer.module import GraphableMegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from sweeper.backends.megatron.equivalence import local_graphs_off


class _Recorder(torch.nn.Module):
    """Stands in for CudaGraphManager: megatron calls it as manager(module, args, kwargs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        self.calls += 1
        return module.forward(*args, **kwargs)


class _Layer(GraphableMegatronModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_the_gate_runs_graphed_layers_eagerly_and_gives_their_managers_back() -> None:
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    layers = torch.nn.Sequential(_Layer(config), _Layer(config))
    managers = []
    for layer in layers:
        layer.cudagraph_manager = _Recorder()  # what GraphableMegatronModule.__init__ makes under cuda_graph_impl local
        managers.append(layer.cudagraph_manager)
    x = torch.ones(2)
    layers(x)
    assert [m.calls for m in managers] == [1, 1]  # megatron routes a graphed layer through its manager
    with local_graphs_off([layers]):
        assert torch.equal(layers(x), x * 4)
        assert [m.calls for m in managers] == [1, 1]  # recorded nothing
        assert not any(hasattr(layer, "cudagraph_manager") for layer in layers)
    layers(x)
    assert [m.calls for m in managers] == [2, 2]  # the steps record as before
    assert [layer.cudagraph_manager for layer in layers] == managers
