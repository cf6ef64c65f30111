"""What this backend can run, decided before anything heavy starts (no megatron import, no process group).

A layout or model feature the backend cannot execute is "unsupported on this backend", never a layout failure:
the same layout may pass on a GPU cluster with Transformer Engine. Reasons name the feature and the backend.
Context and sequence parallelism run without Transformer Engine too (sweeper's own local CP attention and SP norms),
and so does multi-latent attention (Megatron's local MLA spec with a K/V-width-aware core attention).
"""

from __future__ import annotations

from sweeper.backends.megatron import releases
from sweeper.config import megatron_release
from sweeper.config.kernels import Kernels
from sweeper.config.run_settings import RunSettings
from sweeper.models.params import total_params
from sweeper.models.spec import ModelSpec
from sweeper.space.layout import Layout

CPU_MAX_PARAMS = 1_000_000_000


def backend_name(cuda: bool) -> str:
    return "megatron-core-gpu" if cuda else "megatron-core-cpu"


def run_unsupported_reason(run: RunSettings, *, cuda: bool, te: bool) -> str | None:
    """The first run setting (the YAML's ``run:``) this backend cannot build, as a one-line reason; None if none."""
    if cuda and te:
        return None
    backend = backend_name(cuda)
    if run.precision_aware_optimizer:
        return (f"run.precision_aware_optimizer unsupported on this backend ({backend}): megatron-core's precision-"
                "aware optimizer is Transformer Engine's FusedAdam (GPU)")
    if run.optimizer_cpu_offload:
        return (f"run.optimizer_cpu_offload unsupported on this backend ({backend}): Megatron's HybridDeviceOptimizer "
                "moves optimizer state from a GPU to the host")
    return None


def unsupported_reason(spec: ModelSpec, layout: Layout, *, cuda: bool, te: bool,
                       kernels: Kernels | None = None) -> str | None:
    """The first feature of (spec, layout) this backend cannot run, as a one-line reason; None when all can.
    ``kernels``: what the GPU nodes have, as the driver learnt it from them (None: this machine's, on a rank)."""
    backend = backend_name(cuda)

    def no(feature: str, why: str) -> str:
        return f"{feature} unsupported on this backend ({backend}): {why}"

    params = 0 if cuda else total_params(spec)
    if params > CPU_MAX_PARAMS:
        # A CPU rank holds its shard in host memory with FP32 optimizer state (~16 bytes per parameter) and runs
        # at a few GFLOP/s: a production-size model would swap the machine or run for hours, not fail cleanly.
        return no(f"a {params / 1e9:.1f}B-parameter model", f"CPU trials are for models up to "
                  f"{CPU_MAX_PARAMS / 1e9:.0f}B parameters; --proxy runs the same layer structure at CPU size")
    if layout.fsdp:
        why = _fsdp_unsupported(spec, layout, cuda)
        if why:
            return no(f"fsdp {layout.fsdp} (Megatron-FSDP)", why)
    if cuda and te:  # the GPU path (gpu.py) builds MLA and MambaModel; it refuses only what TE/kernels lack
        from sweeper.backends.megatron.gpu import gpu_unsupported_reason

        gpu_reason = gpu_unsupported_reason(spec, layout, kernels=kernels)
        if gpu_reason:
            return no(*gpu_reason)
    # Hybrid Mamba models run on the CPU through sweeper's torch Mamba2 kernels (cpu/mamba.py); a GPU without
    # Transformer Engine would need them too, with mamba_ssm's kernels expected there.
    if spec.is_hybrid and cuda and not te:
        return no("hybrid Mamba model (hybrid_layer_pattern)", "MambaModel's mamba_stack_spec needs Transformer "
                  "Engine on a GPU")
    if spec.multi_latent_attention and cuda and not te:
        return no("multi_latent_attention (MLA)", "MLA's layer spec needs Transformer Engine on a GPU")
    if spec.multi_latent_attention and layout.cp > 1 and not (cuda and te):
        # Megatron's local attention refuses CP ("Context parallelism is only supported by TEDotProductAttention!")
        # and sweeper's CPU CP attention (cpu/attention.py) is written for equal K/V head widths, not MLA's.
        return no(f"multi_latent_attention with context parallel (cp={layout.cp})", "MLA's context-parallel "
                  "attention is Transformer Engine's (cp_comm_type p2p); Megatron's local attention refuses CP")
    if (spec.multi_latent_attention and spec.qk_layernorm and spec.q_lora_rank is None and not (cuda and te)
            and megatron_release.installed() >= releases.MLA_Q_NORM_FUSED):
        # From 0.19 MLA without a query LoRA normalises the query in a fused norm+linear q_proj
        # (transformer/mla_qk_norm_config.py), which only Transformer Engine provides: megatron-core raises
        # "qk_layernorm requires TransformerEngine" (0.16.1 built the kv norm alone, the query unnormalised).
        return no(f"multi_latent_attention with qk_layernorm and no q_lora_rank on megatron-core "
                  f"{megatron_release.installed()}", "its query norm is fused into q_proj, a Transformer Engine layer "
                  "(megatron-core 0.16 builds it without TE)")
    if layout.quantized and not (cuda and te):
        # Without TE megatron-core accepts fp4="e2m1" and trains in BF16 (fp4_utils.get_fp4_context is a
        # nullcontext): a pass would be a false one.
        return no(f"precision {layout.precision}", "FP8 and FP4 GEMMs need Transformer Engine on a GPU")
    if not (cuda and te):
        knob = _gpu_only_knob(layout)
        if knob:
            return no(*knob)
    discarding = [m for m in ("moe_act", "layernorm", "mla_up_proj") if m in layout.recompute_modules]
    if discarding and not (cuda and te):
        # Megatron's output-discarding checkpoint (CheckpointWithoutOutput) asks Transformer Engine for the FP8
        # state; moe_act also needs TE's grouped-GEMM experts ("only supported with moe_grouped_gemm").
        return no(f"recompute module {discarding[0]}", "Megatron's output-discarding checkpoint (moe_act, "
                  "layernorm, mla_up_proj) needs Transformer Engine on a GPU")
    # Without Transformer Engine, CP runs through cpu/attention.py (K/V all-gather, load-balanced causal mask)
    # and SP through cpu/norm.py (norm weights marked sequence_parallel); both are exercised on gloo.
    return None


def _fsdp_unsupported(spec: ModelSpec, layout: Layout, cuda: bool) -> str | None:
    """Why this backend does not run the layout's Megatron-FSDP, or None. Runs: the CPU backend (gloo) with data,
    tensor (dense) and expert parallelism (TP2xDP2, EP2xDP4), every strategy, FP32 and BF16 (docs/MEGATRON_ON_CPU.md
    "Megatron-FSDP"); what has not been run is refused rather than passed unproven."""
    if cuda:
        return ("sweeper's Megatron-FSDP trials have run on the CPU backend only (gloo); the GPU path (device "
                "buffers, the fused PREMUL_SUM gradient reduce, Transformer Engine modules) has not run them")
    untested = [f"{axis}={size}" for axis, size in
                (("pp", layout.pp), ("vpp", layout.vpp), ("cp", layout.cp), ("etp", layout.etp)) if size > 1]
    if layout.tp > 1 and spec.is_moe:  # TP ran on a dense model, EP on an MoE one, not TP with experts
        untested.append(f"tp={layout.tp} on an MoE model")
    if layout.sp:
        untested.append("sp")
    if untested:
        return (f"Megatron-FSDP has run here with data, tensor and expert parallelism; with {', '.join(untested)} it "
                "has not been verified against DDP (equivalence, replicas, fsdp_dtensor checkpoint)")
    if layout.precision not in ("fp32", "bf16"):
        return (f"Megatron-FSDP has run here in fp32 and bf16; {layout.precision} (loss scaling, its optimizer "
                "wrapper) has not")
    return None


def _gpu_only_knob(layout: Layout) -> tuple[str, str] | None:
    """(feature, why) of an issue-18 knob that needs a GPU with Transformer Engine; None when the layout sets none.
    The alltoall and allgather dispatchers run everywhere (cpu.compat)."""
    if layout.dispatcher == "flex":
        return (f"moe_token_dispatcher {layout.moe_token_dispatcher}", "the flex dispatcher's DeepEP and HybridEP "
                "kernels are CUDA (NVSHMEM) libraries; megatron raises 'DeepEP is not installed' without them")
    if layout.moe_a2a_overlap:
        return ("moe_a2a_overlap (overlap_moe_expert_parallel_comm)", "Megatron's combined 1F1B schedule overlaps "
                "the all-to-all on CUDA streams, which are no-ops on the CPU: nothing would overlap")
    if layout.cuda_graph != "none":
        return (f"cuda_graph {layout.cuda_graph}", "CUDA graphs are captured on a GPU (torch.cuda.CUDAGraph, "
                "Transformer Engine's make_graphed_callables)")
    if layout.offload_layers:
        return (f"offload_layers {layout.offload_layers}", "Megatron's activation offload is Transformer Engine's "
                "cpu_offload ('CPU Offloading is enabled when TE is not present', transformer_block.py), and on "
                "the CPU there is no device memory to free")
    return None
