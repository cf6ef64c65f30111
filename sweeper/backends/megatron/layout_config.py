"""The TransformerConfig fields a layout decides (parallel sizes, pipeline split, precision dtype, recompute, the
knobs, the MoE dispatcher), written once for both GPU trials: build.py's own model and Megatron-Bridge's provider
(gpu.bridge_overrides), so a ``model: {hf: DIR}`` trial runs the layout exactly as a preset's does.

Light: torch and sweeper's layout only (gpu.py's pure planning imports it too).
"""

from __future__ import annotations

from typing import Any

import torch

from sweeper.config import megatron_release
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
        # Interleaved schedule: unbatched p2p, overlapped with compute on a GPU, as Megatron-LM runs it
        # (arguments.py core_v0.16.1: --no-overlap-p2p-communication is store_false, validate_args turns it off
        # without VPP, core_transformer_config_from_args sets batch_p2p_comm = not overlap_p2p_comm; Bridge's
        # CommOverlapConfig likewise; schedules.py refuses both together). Batched p2p posts send_prev/recv_prev/
        # send_next/recv_next on one group and tag; with PP=2 "prev" and "next" are the same peer, so on gloo an
        # activation and a gradient (same shape) are matched to each other's receive, silently: PP2+VPP2 computed
        # another model (equivalence gate, gloo: loss 3.49 vs 1.43). The overlap stays off on the CPU: the
        # interleaved schedule frees each sent output (deallocate_output_tensor) before its isend is waited on
        # (schedules.py forward_backward_pipelining_with_interleaving), which NCCL survives (the caching
        # allocator keeps the block for the communication stream) and gloo does not: it sends from the freed
        # host memory (measured: 7% drift in the gate; a bare gloo isend whose tensor's .data is swapped hangs).
        overlap_p2p_comm=cuda and layout.vpp > 1,
        batch_p2p_comm=layout.vpp <= 1,
        **layout.knob_config(megatron_release.graph_modules()),
        **layout.recompute_config(),
    )
    if spec.is_moe:  # alltoall unless the layout says otherwise (on the CPU via cpu.compat)
        out.update(layout.moe_config())
    return out
