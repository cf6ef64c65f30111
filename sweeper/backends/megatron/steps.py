"""One training step of the smoke run: synthetic batches, Megatron's pipeline schedule, optimizer step.

Batches are random token sequences, deterministic in (seed, step, the sequence's index in the step's global
batch): every data-parallel replica takes its contiguous slice of the global batch while the TP/CP/PP ranks of one
replica see the same one, as Megatron's data loader arranges; each CP rank then keeps its load-balanced part of the
sequence (chunks i and 2*CP-1-i). Every layout of one global batch therefore trains on the same data, so two
layouts' loss and gradient-norm trajectories can be compared step by step (the confirmation's trajectory check).
The loss is averaged over micro-batches on the last pipeline stage, then over data-parallel replicas and shared with
every rank, so all ranks report the same loss and stop together on NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from sweeper.backends.megatron import releases
from sweeper.backends.megatron.build import Built
from sweeper.backends.megatron.device import rank_device
from sweeper.backends.megatron.failures import NonFiniteError
from sweeper.space.layout import Layout


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [mbs, seq]
    labels: torch.Tensor  # [mbs, seq]
    position_ids: torch.Tensor  # [mbs, seq]


def micro_batches(
    *, seed: int, step: int, layout: Layout, seq_length: int, vocab_size: int, device: torch.device
) -> list[Batch]:
    """This rank's micro-batches of one step (identical on the TP/CP/PP ranks of one data-parallel replica): its
    data-parallel rank's slice of the step's global batch, whatever the layout."""
    first = parallel_state.get_data_parallel_rank() * layout.mbs * layout.num_microbatches
    out = []
    for index in range(layout.num_microbatches):
        seqs = torch.stack([
            global_sequence(seed, step, first + index * layout.mbs + j, seq_length, vocab_size)
            for j in range(layout.mbs)
        ])
        positions = torch.arange(seq_length).unsqueeze(0).expand(layout.mbs, -1)
        out.append(Batch(seqs[:, :-1].to(device), seqs[:, 1:].contiguous().to(device), positions.to(device)))
    return out


def global_sequence(seed: int, step: int, index: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """Sequence ``index`` of step ``step``'s global batch: ``seq_length + 1`` tokens (inputs and shifted labels)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 10_000_019 + index)
    return torch.randint(0, vocab_size, (seq_length + 1,), generator=gen)


def _loss_func(drift: float, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # Megatron's legacy two-value form: the schedule divides by the number of micro-batches and multiplies by the
    # CP size (DDP then averages gradients over DP x CP), so a CP rank returns its share of the sequence mean:
    # its tokens' mean / CP (equal token counts per CP rank).
    cp_size = parallel_state.get_context_parallel_world_size()
    loss = output.float().mean() / cp_size
    # A copy: the schedule scales the returned loss in place. Reported: the whole sequence's mean, on every CP rank.
    reported = loss.detach().clone()
    if cp_size > 1:
        torch.distributed.all_reduce(reported, group=parallel_state.get_context_parallel_group())
    # Fault injection "drift": this rank's gradient contribution scaled before the data-parallel reduction (the
    # replicas stay identical, the reported loss is the true one): a slow numerical fault no single step shows.
    return (loss * drift if drift != 1.0 else loss), {"lm loss": reported}


def _on_this_cp_rank(batch: Batch) -> Batch:
    """The CP rank's part of the sequence: 2*CP chunks, rank i keeps chunks i and 2*CP-1-i (Megatron's order)."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    parts = releases.batch_on_this_cp_rank(
        {"tokens": batch.tokens, "labels": batch.labels, "position_ids": batch.position_ids}
    )
    return Batch(parts["tokens"], parts["labels"], parts["position_ids"])


def _forward_step(poison: bool, drift: float, data_iterator: Iterator[Batch], model: torch.nn.Module,
                  return_schedule_plan: bool = False) -> tuple[Any, Any]:
    batch = _on_this_cp_rank(next(data_iterator))
    if return_schedule_plan:
        # megatron-core's combined 1F1B schedule (overlap_moe_expert_parallel_comm, pipeline_parallel/
        # combined_1f1b.py, 0.16.1) asks the forward step for the unwrapped GPTModel's schedule plan instead of its
        # output, as Megatron-LM's pretrain_gpt forward step gives it; a step without the keyword raised TypeError
        # there (issue 44, item 1). The plan runs the same forward; fault injection poisons the plain output only.
        plan = model.build_schedule_plan(batch.tokens, batch.position_ids, None, labels=batch.labels)  # type: ignore[operator]
        return plan, partial(_loss_func, drift)
    # attention_mask None: the local and TE attention apply the causal mask themselves.
    output = model(batch.tokens, batch.position_ids, None, labels=batch.labels)
    if poison:
        # Fault injection: a real NaN in this stage's output (loss on the last stage, activations elsewhere)
        # that flows through the rest of the computation to the loss and gradient norm checks.
        output = output * float("nan")
    return output, partial(_loss_func, drift)


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool  # FP16 loss scaler skipped the update (overflow); not a failure by itself


def train_step(
    built: Built, layout: Layout, batches: list[Batch], seq_length: int, *, poison: bool = False, drift: float = 1.0
) -> StepResult:
    """Forward + backward over every micro-batch, gradient sync, optimizer step (see check_finite). ``drift``
    (fault injection): this rank's loss is scaled by it for the backward pass."""
    loss = forward_backward(built, batches, seq_length, layout.mbs, poison=poison, drift=drift)
    success, grad_norm, _ = built.optimizer.step()
    norm = float(grad_norm) if grad_norm is not None else math.nan
    return StepResult(loss=loss, grad_norm=norm, skipped=not success)


def forward_backward(
    built: Built, batches: list[Batch], seq_length: int, micro_batch_size: int, *, poison: bool = False,
    drift: float = 1.0,
) -> float:
    """Zeroed gradients, then forward + backward over ``batches`` and gradient sync (no optimizer step): the
    main gradients are ready for the optimizer. Returns the shared loss (see _shared_loss)."""
    for chunk in built.model:
        chunk.zero_grad_buffer()
    built.optimizer.zero_grad()
    built.refill_param_buffer()  # MXFP8 weights gathered through the grad buffer just zeroed (Megatron-LM's train_step)
    # The interleaved schedule wants one iterator per model chunk; each chunk consumes the same micro-batches.
    iterators: Any = [iter(batches) for _ in built.model] if len(built.model) > 1 else iter(batches)
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, poison, drift),
        data_iterator=iterators,
        model=built.model if len(built.model) > 1 else built.model[0],
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    return _shared_loss(losses)


def check_finite(step: int, result: StepResult) -> None:
    """Raise NonFiniteError when the step's loss or gradient norm is NaN/Inf (same verdict on every rank)."""
    if not math.isfinite(result.loss):
        raise NonFiniteError(f"loss is {result.loss} (not finite) at step {step}")
    # A step the FP16 loss scaler skipped has no gradient norm; that is the scaler working, not a NaN.
    if not result.skipped and not math.isfinite(result.grad_norm):
        raise NonFiniteError(f"gradient norm is {result.grad_norm} (not finite) at step {step}; loss {result.loss:.4f}")


def _shared_loss(losses: list[dict[str, torch.Tensor]]) -> float:
    """Mean loss over micro-batches and data-parallel replicas, identical on every rank (NaN anywhere wins)."""
    pair = loss_pair(losses, parallel_state.is_pipeline_last_stage(ignore_virtual=True), rank_device())
    torch.distributed.all_reduce(pair)
    return float(pair[0] / pair[1])


def loss_pair(losses: list[dict[str, torch.Tensor]], is_last: bool, device: torch.device) -> torch.Tensor:
    """[this rank's mean micro-batch loss, 1] on a last pipeline stage, [0, 0] elsewhere, on ``device``.

    Summed over the whole world: the TP/CP copies of a replica's loss are identical (CP ranks report the whole
    sequence's), so the sum over the count is the data-parallel mean. The losses stay where Megatron left them
    (a GPU's); what is made here is made on the same device."""
    if is_last and losses:
        local = torch.stack([d["lm loss"].float().to(device) for d in losses]).mean()
    else:
        local = torch.zeros((), device=device)
    return torch.stack([local.reshape(()), torch.tensor(1.0 if is_last else 0.0, device=device)])
