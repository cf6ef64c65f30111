"""Named, documented constants of the estimator that a user may override in the YAML's ``estimate:`` section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EstimatorConstants(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # CUDA context + cuBLAS/cuDNN workspaces + kernels loaded by Megatron/TE; not visible to torch's allocator
    # but part of what nvidia-smi shows. ~0.5-1 GiB on Hopper/Blackwell.
    cuda_context_gib: float = Field(0.75, ge=0)
    # NCCL communicator buffers per process group the rank belongs to.
    nccl_buffer_gib_per_group: float = Field(0.06, ge=0)
    # torch reserved / allocated: the caching allocator keeps freed blocks; ~1.1-1.2 in long Megatron runs.
    allocator_fragmentation: float = Field(1.15, ge=1.0)
    # Fraction of the GPU's dense BF16 peak a well-tuned Megatron run reaches (model FLOPs utilisation).
    achievable_mfu: float = Field(0.40, gt=0, le=1)
