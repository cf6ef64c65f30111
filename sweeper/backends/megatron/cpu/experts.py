"""The local experts of a MoE layer as two batched matmuls: the CPU twin of the grouped GEMM the GPU runs.

Megatron's local spec builds a MoE layer's experts as ``SequentialMLP``: one ``MLP`` per local expert, called in a
loop, each with its own fc1, activation and fc2. With a proxy's 128 small experts that is ~400 tiny operators per
layer and micro-batch forward (more backward), whose per-call overhead, not arithmetic, is the CPU's time (issue 31).
``GroupedSequentialMLP`` keeps SequentialMLP's modules, parameters and checkpoint layout (``local_experts.<i>``,
resharded by ``sharded_state_dict`` as before) and replaces only the loop: the tokens are laid out as
``[experts, most tokens of one expert, hidden]`` (zero rows where an expert got fewer), every expert's fc1 and fc2
weight are stacked, and one ``bmm`` each does all experts. The result is SequentialMLP's up to FP32 rounding (the
padding rows are zeros and are dropped; ``tests/backends/test_cpu_experts.py``).

It computes what an expert MLP computes on the CPU: fc1 (+ bias), the activation (the GLU form for gated units,
with the config's clamp and offset), the router probability per token, fc2 (+ bias scaled by the probability, as
MLP.forward adds it for experts). Expert linears do no communication of their own (the dispatcher does), so the
stacked weights are the local shards, as each expert's linear would use them. Anything else (FP8/FP4 padding,
fused or TE activations, a single local expert) falls back to SequentialMLP's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


class GroupedSequentialMLP(SequentialMLP):
    """SequentialMLP with one batched matmul per projection over the local experts (see the module docstring)."""

    def grouped(self) -> bool:
        """Whether this layer takes the batched path (else SequentialMLP's own loop, see the module docstring)."""
        c = self.config
        return (self.num_local_experts > 1 and not (c.fp8 or c.fp4) and not c.use_te_activation_func
                and not c.bias_activation_fusion and not c.moe_apply_probs_on_input)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not self.grouped():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x, probs = permuted_local_hidden_states, permuted_probs
        counts = tokens_per_expert.to(torch.long).cpu()
        experts = len(self.local_experts)
        most = int(counts.max()) if counts.numel() else 0
        if most == 0 or x.shape[0] == 0:
            # No token here: an empty output that still depends on the tokens, their probabilities and every expert
            # weight, as SequentialMLP's calls on empty tokens do. Without the tokens and probabilities in the graph
            # this rank's backward would skip the dispatcher's all-to-alls its peers run (gloo aborts on the
            # mismatch: measured under routing stress, where an EP rank gets no token).
            anchor = x.sum() * 0 + probs.sum() * 0 + sum(e.linear_fc1.weight.sum() * 0 + e.linear_fc2.weight.sum() * 0
                                       for e in self.local_experts)
            return x.new_zeros(x.shape[0], self.config.hidden_size) + anchor, None
        # Row r of x is the (r - start[e])-th token of expert e (the dispatcher sorted them by expert).
        expert_of_row = torch.repeat_interleave(torch.arange(experts), counts)
        start = torch.cumsum(counts, 0) - counts
        slot_of_row = torch.arange(x.shape[0]) - start[expert_of_row]
        expert_of_row, slot_of_row = expert_of_row.to(x.device), slot_of_row.to(x.device)

        padded = x.new_zeros(experts, most, x.shape[-1])
        padded[expert_of_row, slot_of_row] = x
        hidden = GroupedLinear.apply(padded, *[e.linear_fc1.weight for e in self.local_experts])
        if self.local_experts[0].linear_fc1.bias is not None:
            hidden = hidden + torch.stack([e.linear_fc1.bias for e in self.local_experts]).unsqueeze(1)
        hidden = self._activation(hidden)
        scale = probs.new_zeros(experts, most)
        scale[expert_of_row, slot_of_row] = probs
        dtype = hidden.dtype
        hidden = (hidden * scale.unsqueeze(-1)).to(dtype)
        out = GroupedLinear.apply(hidden, *[e.linear_fc2.weight for e in self.local_experts])
        if self.local_experts[0].linear_fc2.bias is not None:
            bias = torch.stack([e.linear_fc2.bias for e in self.local_experts]).unsqueeze(1)
            out = out + bias * scale.unsqueeze(-1)
        return out[expert_of_row, slot_of_row], None

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """MLP.forward's unfused activation (its gated-linear-unit form with the config's clamp and offset)."""
        c = self.config
        if not c.gated_linear_unit:
            return c.activation_func(x)
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if (clamp := c.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return c.activation_func(x_glu) * (x_linear + c.glu_linear_offset)


class GroupedLinear(torch.autograd.Function):
    """``x[e] @ W_e^T`` for every expert e in one bmm. The stacked weights are a copy: made again in backward
    rather than saved, so the graph keeps no second set of expert weights per layer and micro-batch in flight
    (autograd's bmm would save the stack: ~370 MB per micro-batch on the Nemotron proxy's 128 experts)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *weights)
        return torch.bmm(x, torch.stack(weights).transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        grad_x = torch.bmm(grad, torch.stack(weights)) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(grad.transpose(1, 2), x)  # [E, out, in]
        return (grad_x, *grad_w.unbind(0))
