"""The TransformerConfig fields a layout decides (parallel sizes, pipeline split, precision dtype, recompute, the
knobs, the MoE dispatcher), written once for both GPU trials: build.py's own model and Megatron-Bridge's provider
(gpu.bridge_overrides), so a ``model: {hf: DIR}`` trial runs the layout exactly as a preset's does.

Light: torch and sweeper's layout only (gpu.py's pure planning imports it too).
"""

from __future__ import annotations

from typing import Any

import torch

from sweeper.models.spec import ModelSpec
from sweeper.space.layout import Layout

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def params_dtype(layout: Layout) -> torch.dtype:
    # FP8/MXFP8/NVFP4 runs keep BF16 parameters; Transformer Engine casts GEMM inputs.
    return _DTYPES.get(layout.precision, torch.bfloat16)


def layout_config_kwargs(spec: ModelSpec, layout: Layout, *, cuda: bool) -> dict[str, Any]:
    """TransformerConfig kwargs of ``layout`` (the precision recipe itself is the device plan's, gpu.gpu_plan)."""
    dtype = params_dtype(layout)
    out: dict[str, Any] = dict(
        **layout.parallel_sizes(),
        sequence_parallel=layout.sp,
        **layout.pipeline_split_config(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        use_cpu_initialization=not cuda,
        # Megatron-LM's default: pipeline outputs are pseudo-freed and backward calls the C++ autograd engine
        # directly. On the CPU this also keeps backward inside the device mode (torch.autograd.backward would
        # run it from within the mode's own handler, where the mode is suspended).
        deallocate_pipeline_outputs=True,
        # Interleaved schedule: unbatched p2p. Batched p2p posts send_prev/recv_prev/send_next/recv_next on one
        # group and tag; with PP=2 "prev" and "next" are the same peer, so an activation and a gradient (same
        # shape) are matched to each other's receive, silently: PP2+VPP2 computed another model (equivalence gate,
        # gloo: loss 3.49 vs 1.43). Megatron's unbatched p2p sends one direction over another group for 2-rank
        # pipelines. (overlap_p2p_comm, Megatron-LM's VPP default, still drifted by 7% on gloo: left off.)
        batch_p2p_comm=layout.vpp <= 1,
        **layout.knob_config(),
        **layout.recompute_config(),
    )
    if spec.is_moe:  # alltoall unless the layout says otherwise (on the CPU via cpu_compat)
        out.update(layout.moe_config())
    return out
