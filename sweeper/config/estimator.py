"""Named, documented constants of the estimator that a user may override in the YAML's ``estimate:`` section.

Each value is a physical or empirical fact about Megatron-Core on NVIDIA GPUs that the analytic model cannot
derive; defaults are stated with the reason they have that value, so an override is an informed choice.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, model_validator


class EstimatorConstants(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    # -- memory outside torch's caching allocator (not in max_memory_reserved, but it occupies the GPU) ----------
    cuda_context_gib: float = Field(0.75, ge=0)
    """CUDA context + cuBLAS/cuDNN workspaces + kernels loaded by Megatron/TE; not visible to torch's allocator
    but part of what nvidia-smi shows. ~0.5-1 GiB on Hopper/Blackwell."""
    nccl_buffer_gib_per_group: float = Field(0.06, ge=0)
    """NCCL communicator buffers per process group the rank belongs to."""

    # -- memory inside torch's allocator ---------------------------------------------------------------------------
    workspace_gib: float = Field(0.1, ge=0)
    """Workspaces allocated through torch's allocator once and kept: cuBLAS's per-handle workspace
    (CUBLAS_WORKSPACE_CONFIG ":4096:8", 32 MiB), cuBLASLt's, Transformer Engine's GEMM workspace (32 MiB on
    Hopper) and Megatron-Core's global memory buffer for SP/TP gathers. About 0.1 GiB: the model state of every
    small Megatron-LM CI run in tests/data is under-predicted by 0.10-0.13 GiB without it."""
    allocator_fragmentation: PositiveFloat = 1.15
    """Torch's caching allocator keeps freed blocks cached: reserved exceeds allocated by this factor on the
    memory that is allocated and freed within each step (activations, logits, transients). It does not apply to
    the model state: Megatron allocates every parameter and main gradient of a dtype as one contiguous tensor
    (megatron/core/distributed/param_and_grad_buffer.py, _ParamAndGradBuffer.__init__: self.param_data /
    self.grad_data = torch.zeros(self.numel, ...)) and the optimizer's shards once, before the first step. With
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the slack is close to 1.0."""
    logits_bytes_per_element: float = Field(6.0, ge=0)
    """Bytes per element of the last stage's logits path for one micro-batch: the fp32 copy that
    vocab_parallel_cross_entropy makes and keeps as the softmax for backward (4) plus the bf16 logits / bf16
    logits-gradient that live next to it (2)."""
    fp8_weight_cache_bytes_per_param: float | None = Field(None, ge=0)
    """Override of the bytes per linear-layer weight TE keeps besides the BF16 weight under FP8/MXFP8 (None:
    derived from the recipe, the device and run.fp8_param_gather, memory.fp8_weight_bytes). The run settings that
    move memory (grad dtype, moment dtypes, offload, FP8 weights) are the YAML's ``run:``
    (sweeper.config.run_settings)."""
    moe_dispatch_buffer_copies: float = Field(2.0, ge=0)
    """Transient copies of the routed tokens a MoE all-to-all dispatcher holds while one layer runs (permuted
    send buffer + received buffer), in units of (routed tokens x hidden x 2 bytes)."""
    cuda_graph_static_copies: float = Field(2.0, ge=0)
    """Static tensors a captured CUDA graph keeps per graphed block and micro-batch, in units of the block's
    hidden state (tokens x hidden x 2 bytes): its input and its output (memory.graph_static_bytes)."""
    moe_hot_rank_factor: float = Field(1.2, ge=1.0)
    """Routed tokens the busiest expert-parallel rank receives over the mean, for dropless MoE: the permuted
    tokens, the experts' activations and the dispatch buffers follow the hottest rank, and early steps route
    unevenly (capped by memory.hot_rank_factor's bound; EP 1 has none). 1.2: the published dropless runs' peaks
    (max over their first 100 steps) imply 1.1-1.25 (benchmarks/estimate_accuracy.py: with 1.0 all eight MoE
    cases at EP 4-8 are under-predicted, by 0.3-4.9%); a sweep raises it to what its own trials' routers measured
    (backends/megatron/routing.py, metrics.moe_hot_rank_factor)."""
    mamba_chunk_size: int = Field(128, ge=1)
    """Megatron's Mamba mixer trains with the fused memory-efficient path (use_mamba_mem_eff_path=True), which
    recomputes the convolution and scan internals in backward; its chunk size sets the SSD scan cost."""

    # -- settings of the production run that the layout does not carry (Megatron-LM flags) ----------------------
    attention_backend: Literal["flash", "unfused", "local"] = "flash"
    """--attention-backend of the production run: flash/fused attention (TE's default) keeps no score matrices;
    unfused keeps every attention layer's softmax output, mbs x heads/TP x seq/CP x seq in BF16 (TE's fused softmax
    kernel), for backward; local is megatron-core's local spec without Transformer Engine, whose torch softmax runs
    in FP32 (attention_softmax_in_fp32) and keeps that output and its BF16 copy (6 bytes per score; measured on an
    H200: docs/support-matrix.md)."""
    hidden_dropout: float = Field(0.0, ge=0, lt=1)
    """--hidden-dropout of the production run. Megatron-LM's default is 0.1; Megatron-Bridge's recipes for current
    models (and sweeper's smoke runs) use 0. Above 0, every block keeps its dropout mask (1 byte per element), and
    unfused attention keeps the score dropout's mask and output too."""
    attention_dropout: float = Field(0.0, ge=0, lt=1)
    """--attention-dropout of the production run (see hidden_dropout)."""

    # -- how far the memory prediction may be off (pruning under uncertainty, issue 13) -----------------------------
    memory_over_prediction: float = Field(0.20, ge=0, le=1)
    """The band of the measured peak around a prediction P: [P / (1 + memory_over_prediction), P / (1 -
    memory_under_prediction)]. A sweep prunes a layout as out of memory only when even the band's lower end
    exceeds the limit; a layout inside the band is launched as a calibration probe. The defaults are the worst
    peak-memory error benchmarks/estimate_accuracy.py measures over all modelled published cases (19.0%), rounded
    up (the 7B+ cases are within 4.4%); a user who calibrated on their cluster may narrow them."""
    memory_under_prediction: float = Field(0.20, ge=0, lt=1)
    """How far the measured peak may lie above a prediction (see memory_over_prediction)."""

    # -- step time -------------------------------------------------------------------------------------------------
    achievable_mfu: float = Field(0.59, gt=0, le=1)
    """Fraction of the GPU's dense BF16 peak that a block's GEMMs and attention reach in a well-tuned Megatron run
    (its compute alone: communication, the pipeline bubble and the optimizer step are terms of their own). Fitted
    with comm_efficiency on 63 published runs (benchmarks/first_guess.py: Parallel Folding's H100 MoE runs,
    MegaScale's and Korthikanti et al.'s A100 GPT runs; 0.588 on all of them): each source's model predicted with
    the two fitted on the others lies 9.2% off its measured step time at the median before any trial (42.6% with
    the 0.40 assumed before), 97.8% of its pairs of layouts in the measured order (97.4% before). The CPU backend's
    ranks keep 0.40 (CPU_RANK_EFFICIENCIES)."""
    throughput_low: float = Field(0.65, gt=0)
    """How far a measured throughput may lie from an uncalibrated prediction, as measured / predicted: the band
    of the decision section's projections when no trial measured the real device (a CPU sweep). Set from
    benchmarks/first_guess.py: over the 63 published runs (H100 MoE, A100 GPT; BF16), each source's model predicted
    with the step-time defaults fitted on the others, the measured throughput was 0.68-1.63 x the predicted (with
    the defaults fitted on all of them 0.77-1.60), rounded out. The published FP8 runs (H800, GB200; issue 52), each
    predicted with the FP8 efficiencies fitted on the others, lie 0.94-1.07 (benchmarks/first_guess.py)."""
    throughput_high: float = Field(1.65, gt=0)
    """The band's high end, as measured / predicted (see throughput_low)."""
    achievable_mfu_fp8: float = Field(0.44, gt=0, le=1)
    """Fraction of the FP8 peak reached by the dense GEMMs (attention projections, MLPs, shared experts) of every
    FP8 recipe and MXFP8, casts and scales included (blockwise's GEMM factor and tensorwise's amax pass are priced
    on top of it). Fitted with achievable_mfu_fp8_experts on the published FP8 runs of
    tests/data/measured_throughput_fp8.json (benchmarks/first_guess.py, issue 52): torchtitan's Llama 3.1 8B on 8
    H100 in tensorwise FP8 against its BF16 twin (the speed-up: 1.28x end to end), DeepSeek-V3 on 2048 H800 in
    blockwise FP8 (its report's GPU hours per token) and on 256 GB200 in MXFP8 (Megatron-LM's optimised run): 0.441
    on all three, 0.41-0.44 with one left out. The 0.44 assumed before (three quarters of achievable_mfu) stands;
    what the dense runs could not tell is that routed experts reach far less (achievable_mfu_fp8_experts): with one
    efficiency for both the three runs ask 0.27-0.40 of each other and each lies 15-23% off predicted from the
    others, 4-7% with the two. No delayed-scaling or NVFP4 run with its layout was found to check."""
    achievable_mfu_fp8_experts: float = Field(0.23, gt=0, le=1)
    """Fraction of the FP8 peak reached by the routed experts' grouped GEMMs under FP8 and MXFP8 (each expert's few
    rows quantised, padded to 16 or 32 and multiplied apart: fine-grained experts gain little from FP8). Fitted
    with achievable_mfu_fp8 (see there): 0.234 on all three runs, 0.22-0.25 with one left out, set by the two
    DeepSeek-V3 runs (256 experts of 2048, 8 routed per token) alone: an expert of Mixtral's size (14336) may reach
    more, which no published FP8 run here tells. BF16 experts keep achievable_mfu (fitted on MoE runs with them)."""
    achievable_mfu_fp4: float = Field(0.32, gt=0, le=1)
    """Fraction of the dense NVFP4 peak reached by NVFP4 GEMMs: lower again (16-element block scales, the random
    Hadamard transform on the weight-gradient inputs, stochastic rounding of gradients). An assumption, not a
    measurement (no NVFP4 run has been timed by sweeper): 0.55 of achievable_mfu, as 0.22 was of 0.40 (NVFP4 GEMMs
    2.2x BF16's on a B200)."""
    comm_efficiency: float = Field(0.77, gt=0, le=1)
    """Fraction of the link bandwidth a NCCL collective actually achieves (bus bandwidth / link bandwidth). Fitted
    with achievable_mfu on the published runs (benchmarks/first_guess.py: 0.774 on all of them, 0.75-0.93 with one
    source's model left out; 0.70 assumed before). Kept when issue 52 priced expert dispatch by what each dispatcher
    moves over NVLink and the NIC: with it the 63 runs lie 8.6% off at the median (8.8% before), while a refit on all
    six families would give 0.655 (achievable_mfu 0.609), pulled by the 64-expert Mixtral G8T8 runs whose cost the
    exchange's bytes no longer explain, and predicts each family left out 11.3% off (9.2% before). The CPU backend's
    ranks keep 0.70 (CPU_RANK_EFFICIENCIES)."""
    cp_comm_overlap: float = Field(0.5, ge=0, le=1)
    """Fraction of context-parallel KV exchange hidden behind attention compute (TE overlaps the ring steps)."""
    dp_comm_overlap: float = Field(0.8, ge=0, le=1)
    """Fraction of data-parallel gradient reduce / parameter gather hidden behind backward/forward when the run
    overlaps them (run.overlap_grad_reduce, e.g. Bridge's pretrain default); nothing is hidden when it does not."""
    flex_comm_efficiency: float = Field(0.9, gt=0, le=1)
    """Fraction of link bandwidth the flex dispatcher's DeepEP / HybridEP kernels reach: DeepEP's README reports
    ~153-158 GB/s of H800's ~160 GB/s NVLink intranode and ~43-58 GB/s of a 50 GB/s (400 Gb/s) RDMA NIC for its
    normal kernels, against comm_efficiency for NCCL's all-to-all."""
    moe_a2a_overlap_efficiency: float = Field(0.8, ge=0, le=1)
    """Fraction of the expert all-to-all hidden behind another micro-batch's compute with moe_a2a_overlap
    (Megatron's combined 1F1B), at most that compute's length: the dispatch and combine of one micro-batch overlap
    the other's layer (attention and expert GEMMs), less the synchronisation between them. An assumption, not
    fitted: the one published pair (Megatron-MoE-ModelZoo's Qwen3-235B-A22B on 256 H100, DeepEP at EP32, 19.7 s
    without and 17.6 s with the overlap; tests/data/measured_throughput_dispatch.json) saved 11% where 0.8 predicts
    31%, as about 0.27 would; DeepEP's SMs, taken from the overlapped GEMMs, are not modelled either."""
    kernel_launch_us: float = Field(6.0, ge=0)
    """Host time to launch one kernel in eager PyTorch with Transformer Engine (Python dispatch + CUDA launch);
    what a block whose kernels are short waits for without CUDA graphs (step_time.KERNELS_PER_SCOPE)."""
    link_latency_us: float = Field(5.0, ge=0)
    """Latency of one hop of a ring collective or a point-to-point send (NCCL's per-step latency, a few
    microseconds over NVLink and InfiniBand): a collective over G ranks pays G - 1 of them besides its bytes, which
    is what small messages (a tiny model, a short micro-batch, gloo on the CPU backend) are made of."""

    @model_validator(mode="after")
    def _throughput_band(self) -> EstimatorConstants:
        if self.throughput_low > self.throughput_high:
            raise ValueError(f"throughput_low ({self.throughput_low}) must not exceed throughput_high "
                             f"({self.throughput_high})")
        return self


# The step-time efficiencies the CPU backend's ranks are priced with (a simulated cluster's trials: the Estimator's
# host_cores) where the YAML sets none: the defaults before the GPU's were fitted on published runs (issue 46; FP8
# and NVFP4 moved with them, though the CPU backend runs neither: kept so that nothing of its pricing moves, the FP8
# experts' efficiency of issue 52 at FP8's). A CPU rank's terms are the configured GPU's, scaled by the cores it
# shares, and its trials fit them term by term from there (estimate.step_fit); the recorded CPU landscapes
# (tests/data/landscape_*.json) are explained from these terms' weights: the dense one's 80 layouts within 9.0%
# median error, against 41.5% from the fitted GPU defaults (its forward selection frees other terms).
CPU_RANK_EFFICIENCIES: dict[str, float] = {"achievable_mfu": 0.40, "comm_efficiency": 0.70,
                                           "achievable_mfu_fp8": 0.30, "achievable_mfu_fp8_experts": 0.30,
                                           "achievable_mfu_fp4": 0.22}
