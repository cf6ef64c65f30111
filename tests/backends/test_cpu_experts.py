"""GroupedSequentialMLP (cpu/experts.py) against megatron-core's own SequentialMLP: the same local experts, weights
and routed tokens give the same output and the same gradients to FP32 rounding (issue 31), for gated (SwiGLU) and
plain (squared ReLU, Nemotron's) experts, with experts that get no token, and at ETP 2 (each rank's shards). Real
megatron-core modules in gloo ranks; no stand-ins. (Expert biases are not compared: megatron-core 0.16.1's own
SequentialMLP fails with them at ETP 1, an in-place add on its reduce's output view.)"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_cpu_parallel import _in_ranks


def _compare(rank: int, etp: int, gated: bool, bias: bool, empty: bool) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from sweeper.backends.megatron.cpu.experts import GroupedSequentialMLP

    parallel_state.initialize_model_parallel(expert_tensor_parallel_size=etp, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(7)
    experts = 6
    config = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_moe_experts=experts,
        moe_ffn_hidden_size=16, moe_router_topk=2, gated_linear_unit=gated, add_bias_linear=bias,
        activation_func=F.silu if gated else (lambda x: torch.relu(x) ** 2), use_cpu_initialization=True,
        expert_tensor_parallel_size=etp, params_dtype=torch.float32,
    )
    def inner(spec):  # a ModuleSpec, or from megatron-core 0.19 functools.partial(<class>, submodules=...)
        return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules

    submodules = inner(inner(inner(get_gpt_layer_local_spec(num_experts=experts)).mlp).experts)
    pg = get_default_pg_collection()
    torch.manual_seed(3)
    ours = GroupedSequentialMLP(experts, config, submodules, pg_collection=pg)
    theirs = SequentialMLP(experts, config, submodules, pg_collection=pg)
    theirs.load_state_dict(ours.state_dict())
    counts = torch.tensor([5, 0, 3, 9, 1, 4] if empty else [5, 2, 3, 9, 1, 4])
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(int(counts.sum()), 32, generator=gen)
    probs = torch.rand(int(counts.sum()), generator=gen)
    out: dict[str, float] = {}
    results = []
    for module in (ours, theirs):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, y_bias = module(xi, counts, pi)
        assert y_bias is None
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y.detach(), xi.grad, pi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (y0, gx0, gp0, g0), (y1, gx1, gp1, g1) = results

    def rel(a: Any, b: Any) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    # A rank whose experts got no token (routing stress): the tokens and probabilities stay in the graph, so its
    # backward runs the dispatcher's all-to-alls as its peers do.
    xe, pe = x[:0].clone().requires_grad_(), probs[:0].clone().requires_grad_()
    ye, _ = ours(xe, torch.zeros(experts, dtype=torch.long), pe)
    ye.sum().backward()
    assert ye.shape == (0, 32) and xe.grad is not None and pe.grad is not None

    out["output"] = rel(y0, y1)
    out["input_grad"] = rel(gx0, gx1)
    out["probs_grad"] = rel(gp0, gp1)
    for name, grad in g1.items():
        if grad is None:  # an expert without tokens: Megatron's loop never touches it
            assert g0[name] is None or float(g0[name].abs().max()) == 0.0, name
            continue
        out[name] = rel(g0[name], grad)
    return out


@pytest.mark.parametrize(("etp", "gated", "bias", "empty"), [
    (1, True, False, False), (1, False, False, True), (2, True, False, True), (2, False, False, False),
], ids=["swiglu", "relu2-empty-expert", "etp2-swiglu-empty-expert", "etp2-relu2"])
def test_grouped_experts_compute_what_sequential_mlp_computes(etp: int, gated: bool, bias: bool, empty: bool) -> None:
    for errors in _in_ranks(_compare, etp, etp, gated, bias, empty):
        worst = max(errors, key=errors.get)
        print(f"\n[grouped experts] worst {worst}: {errors[worst]:.2e}")
        assert errors[worst] < 1e-6, f"{worst}: {errors[worst]:.2e} ({errors})"
        assert len(errors) > 3
