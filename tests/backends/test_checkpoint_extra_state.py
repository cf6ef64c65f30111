"""Issue 44 (14b): the checkpoint reload check compares every module's ``_extra_state`` (Transformer Engine keeps its
FP8 scales there), so a checkpoint that loses them fails. No Transformer Engine here: the smallest module with an
extra state of its own, through torch's real state-dict round trip."""

from __future__ import annotations

import torch

from sweeper.backends.megatron.checkpoint import compare_extra_states, extra_states


class _Scaled(torch.nn.Module):
    """A linear layer with FP8-style metadata (a scale) kept as extra state, as Transformer Engine's modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scale = torch.tensor([0.125, 3.0])

    def get_extra_state(self) -> torch.Tensor:
        return self.scale.clone()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.scale = state.clone()


def test_an_extra_state_that_comes_back_as_saved_passes_and_a_lost_or_changed_one_is_caught() -> None:
    chunks = [torch.nn.Sequential(_Scaled(), torch.nn.ReLU(), _Scaled())]
    saved = extra_states(chunks)
    assert sorted(key for _, key in saved) == ["0._extra_state", "2._extra_state"]
    assert compare_extra_states(saved, [chunks[0].state_dict()]) == []
    lost = {k: v for k, v in chunks[0].state_dict().items() if k != "2._extra_state"}  # the scales not written
    assert compare_extra_states(saved, [lost]) == ["2._extra_state"]
    reset = chunks[0].state_dict() | {"0._extra_state": torch.tensor([1.0, 1.0])}  # the scales back at 1
    assert compare_extra_states(saved, [reset]) == ["0._extra_state"]


def test_modules_without_extra_state_are_not_compared() -> None:
    assert extra_states([torch.nn.Sequential(torch.nn.Linear(2, 2))]) == {}
