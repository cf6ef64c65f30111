"""The one device decision of a rank: every tensor sweeper creates on a rank lives on ``rank_device()``.

Megatron keeps what the loss function returns where the model computed it (the rank's CUDA device on a GPU), so a
tensor sweeper makes beside it (a count, a flag) must be made there too: ``torch.stack`` and the collectives
refuse mixed devices.
"""

from __future__ import annotations

import torch


def rank_device() -> torch.device:
    """This rank's current CUDA device on a GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
