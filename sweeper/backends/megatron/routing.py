"""How unevenly the smoke run's router sends tokens to the expert-parallel ranks (issue 13, MoE routing imbalance).

Dropless MoE sizes the permuted-token buffers and the experts' activations by what each EP rank receives, so
memory follows the busiest rank, and early steps route very unevenly. During the steps, a forward hook on every
``TopKRouter`` (megatron/core/transformer/moe/router.py; ``forward`` returns ``(probs, routing_map)`` with
``routing_map`` a tokens x experts mask) counts this rank's tokens per expert for each forward. After the steps,
one all-reduce over the expert-parallel group sums what every rank of the group sent to each expert, the counts are
folded into EP ranks (rank r holds experts r*E/EP ... (r+1)*E/EP - 1) and the hot-rank factor is the largest
ratio, over layers and forwards, of the busiest rank's tokens to the mean. The estimator scales its routed-token
memory by it (``EstimatorConstants.moe_hot_rank_factor``, raised by calibration to what trials measured).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch

StressMode = Literal["hot_expert", "hot_rank"]
STRESS_MODES: tuple[StressMode, ...] = ("hot_expert", "hot_rank")
# Added to the hot experts' router logits (O(1) otherwise): every token's top-k takes them first, in any router
# dtype (fp16 included) and through softmax, sigmoid and group-limited routing alike.
STRESS_BIAS = 1e4


class RoutingProbe:
    def __init__(self, chunks: list[Any]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts: list[torch.Tensor] = []
        self.handles = [module.register_forward_hook(self._hook)
                        for chunk in chunks for module in chunk.modules() if isinstance(module, TopKRouter)]

    def _hook(self, _module: Any, _inputs: Any, output: Any) -> None:
        routing_map = output[1]
        self.counts.append(routing_map.detach().sum(dim=0, dtype=torch.int64))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def hot_rank_factor(self, ep: int, device: torch.device) -> float | None:
        """Collective over the EP group (every rank of it must call it): the busiest EP rank's tokens over the
        mean, worst over layers and forwards; None without EP or without a routed forward."""
        from megatron.core import parallel_state

        self.remove()
        if ep <= 1 or not self.counts:
            return None
        counts = torch.stack(self.counts).to(device)  # forwards x experts, this rank's tokens
        torch.distributed.all_reduce(counts, group=parallel_state.get_expert_model_parallel_group())
        per_rank = counts.view(counts.shape[0], ep, -1).sum(dim=-1).double()  # forwards x EP ranks, received
        mean = per_rank.mean(dim=1).clamp(min=1.0)
        return float((per_rank.max(dim=1).values / mean).max())


@contextlib.contextmanager
def forced_routing(chunks: list[Any], mode: StressMode, ep: int) -> Iterator[int]:
    """Routing stress for the block: every TopKRouter's logits get ``STRESS_BIAS`` on its hot experts, expert 0
    (``hot_expert``: each token's first choice is that one expert) or the experts of EP rank 0 (``hot_rank``: each
    token's top-k lands on one rank as far as it holds k experts). Dropless MoE then sizes the hot rank's
    permutation buffers and expert activations for that load, which is what grows memory after steps of uneven
    routing. Yields the number of routers stressed; their gating is restored after the block."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        experts = router.config.num_moe_experts
        bias = torch.zeros(experts)
        bias[: 1 if mode == "hot_expert" else max(1, experts // ep)] = STRESS_BIAS

        def gating(inputs: torch.Tensor, _gating: Any = router.gating, _bias: torch.Tensor = bias) -> torch.Tensor:
            logits = _gating(inputs)
            return logits + _bias.to(device=logits.device, dtype=logits.dtype)

        router.gating = gating  # an instance attribute shadows the method TopKRouter.forward calls
    try:
        yield len(routers)
    finally:
        for router in routers:
            del router.gating
