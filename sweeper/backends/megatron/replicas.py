"""Replica consistency: every copy of a replicated parameter must be bit-identical after the steps.

Megatron keeps a parameter in several places and relies on the gradient reduction (and, with the distributed
optimizer, the parameter all-gather) to keep the copies equal: dense weights across the data- and
context-parallel ranks, expert weights across the expert-data-parallel ranks, weights that tensor parallelism
does not shard (norms, the router) across the tensor- (expert-tensor-) parallel ranks, and tied word embeddings
across the first and last pipeline stage. If a reduction runs over the wrong group the run goes on, the loss
stays finite, and each replica trains its own model; only comparing the copies shows it.

The replica groups here come from Megatron's parallel_state and from where a parameter lives in the model (a
parameter of an experts module is an expert parameter), never from the flags DDP used to reduce it, so a
mis-tagged parameter is compared across the group it really belongs to. Each rank reduces every parameter to an
exact integer checksum of its bits (no rounding: replicas are equal bit for bit or not at all), the checksums are
all-gathered per group, and the first difference is reported on every rank. Where DDP's own tag shows why (an
expert weight reduced as a dense one over a data-parallel group that is not its expert-data-parallel group:
megatron-core below 0.19 at EP 1 with ETP != TP), the report names that cause, Megatron's.

Megatron-FSDP keeps one shard of each parameter per data-parallel rank: the full weights are all-gathered first
(``_fsdp_replicated_params``) and compared across the groups that still hold copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model

from sweeper.backends.megatron import releases
from sweeper.backends.megatron.build import Built
from sweeper.backends.megatron.failures import ReplicaDivergenceError

_CHUNK = 1 << 24  # elements per checksum slice: bounds the temporary int64 copy of a large parameter
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class _GroupKind:
    name: str  # as the error names it
    group: Callable[[], torch.distributed.ProcessGroup | None]


# The order is the same on every rank: each rank belongs to exactly one group of each kind, so the per-kind
# all-gathers line up.
_KINDS = {
    "dp": _GroupKind("data-parallel (x context-parallel)",
                     lambda: ps.get_data_parallel_group(with_context_parallel=True)),
    "edp": _GroupKind("expert-data-parallel", ps.get_expert_data_parallel_group),
    "tp": _GroupKind("tensor-parallel", ps.get_tensor_model_parallel_group),
    "etp": _GroupKind("expert-tensor-parallel", ps.get_expert_tensor_parallel_group),
    "embedding": _GroupKind("embedding (first and last pipeline stage)",
                            lambda: ps.get_embedding_group() if ps.is_rank_in_embedding_group() else None),
}


def check_replicas(built: Built, step: int, device: torch.device) -> int:
    """Raise ReplicaDivergenceError on every rank when any replicated parameter differs between its copies.

    Returns how many replicated tensors this rank compared (0 when nothing is replicated, e.g. one rank)."""
    members = _replicated_params(built)
    local_bad: list[str] = []
    causes: list[str] = []
    compared = 0
    for key, kind in _KINDS.items():
        group = kind.group()
        params = members[key]
        if group is None or torch.distributed.get_world_size(group) == 1 or not params:
            continue
        sums = torch.stack([_checksum(p) for _, p in params]).to(device)
        gathered = [torch.empty_like(sums) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(gathered, sums, group=group)
        compared += len(params)
        ranks = torch.distributed.get_process_group_ranks(group)
        for i, (name, param) in enumerate(params):
            if any(not torch.equal(other[i], gathered[0][i]) for other in gathered[1:]):
                local_bad.append(f"{name} differs across its {kind.name} group (global ranks {ranks})")
                if key == "edp" and _reduced_over_dense_group(param, ranks):
                    causes.append(_DENSE_EXPERT_CAUSE)
    findings: list[tuple[str | None, int, int, str | None] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        findings, (local_bad[0] if local_bad else None, len(local_bad), compared, causes[0] if causes else None))
    bad = [(rank, f) for rank, f in enumerate(findings) if f is not None and f[1]]
    if bad:
        rank, (first, count, total, cause) = bad[0]
        # A known cause before the count: the failure's one line is capped at 400 characters (failures.one_line).
        raise ReplicaDivergenceError(
            f"replica divergence after step {step}: {first}; " + (f"{cause}; " if cause else "")
            + f"rank {rank} has {count} of {total} replicated tensors differing from their copies"
        )
    return compared


# Megatron's defect, not the layout's arithmetic (the same run on GPUs diverges alike): megatron-core below 0.19 tags
# every expert linear dense when expert_model_parallel_size is 1 (``param.allreduce = not EP > 1`` in
# tensor_parallel/layers.py ColumnParallelLinear/RowParallelLinear.__init__ and extensions/transformer_engine.py
# TELinear/TEGroupedLinear), so DDP reduces its gradient over the data-parallel group; with ETP != TP that is not
# the expert-data-parallel group and each copy keeps part of the gradient (tests/backends/test_expert_grads_etp.py).
# Fixed in 0.19 (NVIDIA/Megatron-LM#5916, ``use_expert_pgs``); the rule refuses the layout before launch below it.
_DENSE_EXPERT_CAUSE = ("Megatron reduced the expert gradients over the data-parallel group (EP 1, ETP != TP: "
                       "NVIDIA/Megatron-LM#5916, rule expert_grads_reduced_over_expert_dp)")


def _reduced_over_dense_group(param: torch.Tensor, edp_ranks: list[int]) -> bool:
    """Whether DDP took this expert weight for a dense one (``allreduce`` true: reduced over the data-parallel
    group) while its expert-data-parallel group is another group: then its copies never shared a gradient."""
    if not getattr(param, "allreduce", True):
        return False
    dp_ranks = torch.distributed.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))
    return sorted(dp_ranks) != sorted(edp_ranks)


def _replicated_params(built: Built) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Per group kind, this rank's parameters that have a copy on every other rank of that group (by name)."""
    if built.fsdp:
        return _fsdp_replicated_params(built)
    out: dict[str, list[tuple[str, torch.Tensor]]] = {key: [] for key in _KINDS}
    expert = {id(p) for ddp in built.model for m in ddp.modules() if isinstance(m, _EXPERT_MODULES)
              for p in m.parameters()}
    for name, param in built.named_parameters().items():
        is_expert = id(param) in expert
        out["edp" if is_expert else "dp"].append((name, param))
        if not getattr(param, "tensor_model_parallel", False):
            out["etp" if is_expert else "tp"].append((name, param))
    for index, ddp in enumerate(built.model):
        model = unwrap_model(ddp)
        if getattr(model, "share_embeddings_and_output_weights", False) and (
            getattr(model, "pre_process", False) or getattr(model, "post_process", False)
        ):
            out["embedding"].append((f"chunk{index}.shared_embedding_or_output_weight",
                                     model.shared_embedding_or_output_weight()))
    return out


_EXPERT_MODULES = releases.expert_mlp_classes()


def _checksum(param: torch.Tensor) -> torch.Tensor:
    """[sum of the bit patterns, position-weighted sum] as int64: equal for bit-identical tensors, and a change of
    any element (or two elements trading places) changes it. Integer sums wrap but stay exact and order-free."""
    data = param.detach()
    if data.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        data = data.float()  # e.g. Transformer Engine's FP8 parameters: compare their dequantised values
    bits = data.contiguous().view(-1).view(_INT_VIEW[data.element_size()])
    plain = torch.zeros((), dtype=torch.int64, device=bits.device)
    weighted = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
        plain += part.sum()
        weighted += (part * weights).sum()
    return torch.stack([plain, weighted])


def _fsdp_replicated_params(built: Built) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Megatron-FSDP: the full weights of the parameters that have copies across TP, ETP or the embedding group.

    Each distributed parameter is all-gathered over its data-parallel group with Megatron's uneven-DTensor gather
    (a collective: every rank walks the parameters in the same order and makes the same choice, which depends only
    on what the ranks of one data-parallel group share: the model part, the group sizes). The module's own
    parameters are not read: under optim_grads_params they are views into a released all-gather buffer. Across
    the data-parallel (expert-data-parallel) group itself nothing is compared: the gather assembles one tensor
    from the ranks' disjoint shards, so it is identical on every rank by construction."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_uneven_dtensor_to_full_tensor
    from torch.distributed.tensor import DTensor

    out: dict[str, list[tuple[str, torch.Tensor]]] = {key: [] for key in _KINDS}
    sizes = {key: _size(kind) for key, kind in _KINDS.items()}
    bare = built.bare_chunks()
    expert_prefixes = [tuple(f"{name}." for name, m in chunk.named_modules() if isinstance(m, _EXPERT_MODULES))
                       for chunk in bare]
    tied = [_tied_embedding_name(chunk) for chunk in bare]
    for index, name, param in built.fsdp_parameters():
        kinds = []
        if not getattr(param, "tensor_model_parallel", False):
            kinds.append("etp" if name.startswith(expert_prefixes[index]) else "tp")
        if name == tied[index]:
            kinds.append("embedding")
        kinds = [key for key in kinds if sizes[key] > 1]
        if not kinds:
            continue
        full = gather_uneven_dtensor_to_full_tensor(param) if isinstance(param, DTensor) else param
        full = full.to_local() if isinstance(full, DTensor) else full
        for key in kinds:
            out[key].append((f"chunk{index}.{name}", full))
    return out


def _size(kind: _GroupKind) -> int:
    group = kind.group()
    return 1 if group is None else torch.distributed.get_world_size(group)


def _tied_embedding_name(chunk: torch.nn.Module) -> str | None:
    """The name (inside the chunk) of the word embedding / output weight a first or last pipeline stage shares."""
    model = unwrap_model(chunk)
    if not (getattr(model, "share_embeddings_and_output_weights", False)
            and (getattr(model, "pre_process", False) or getattr(model, "post_process", False))):
        return None
    prefix = "module." if model is not chunk else ""
    return prefix + ("embedding.word_embeddings.weight" if model.pre_process else "output_layer.weight")
