"""The smoke run's data is the same in every layout of one global batch (issue 53: a confirmation's trajectory is
compared with the reference layout's). Only the data-parallel rank is asked of Megatron's parallel state, and this
unit test of the slicing sets it (monkeypatched) instead of building process groups."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state

from sweeper.backends.megatron import steps
from sweeper.space.layout import Layout

SEQ, VOCAB = 16, 128


def _global_batch(layout: Layout, step: int, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """Every data-parallel rank's micro-batches of ``step``, in rank order: the sequences the step trained on."""
    parts = []
    for dp_rank in range(layout.dp):
        monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda rank=dp_rank: rank)
        for batch in steps.micro_batches(seed=7, step=step, layout=layout, seq_length=SEQ, vocab_size=VOCAB,
                                         device=torch.device("cpu")):
            parts.append(torch.cat([batch.tokens, batch.labels[:, -1:]], dim=1))
    return torch.cat(parts)


def test_every_layout_of_one_global_batch_trains_on_the_same_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    one = _global_batch(Layout(world_size=1, gbs=8), 3, monkeypatch)
    assert one.shape == (8, SEQ + 1)
    for layout in (Layout(world_size=2, gbs=8), Layout(world_size=4, gbs=8, mbs=2),
                   Layout(world_size=4, tp=2, gbs=8, mbs=4), Layout(world_size=2, pp=2, gbs=8, mbs=2)):
        assert torch.equal(_global_batch(layout, 3, monkeypatch), one), layout.short()
    # and each step, each sequence is its own
    assert not torch.equal(_global_batch(Layout(world_size=1, gbs=8), 4, monkeypatch), one)
    assert len({tuple(row.tolist()) for row in one}) == 8
