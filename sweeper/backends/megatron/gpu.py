"""The GPU branch of the megatron backend: Transformer Engine specs, FP8/MXFP8 recipes, MLA, hybrid Mamba, Bridge.

``gpu_plan(spec, layout, capability)`` is the pure heart of it: it maps a ModelSpec, a Layout and the device's
compute capability to the Megatron model class, the TransformerConfig class and the extra TransformerConfig
kwargs (precision recipe, MLA and Mamba fields, CP through TE), plus notes the trial reports (the FP8 recipe
chosen, a missing Mamba fast path). It imports nothing heavy, so it is unit-tested on CPU. The builders below
it (``gpu_model_class`` for build.py, ``bridge_provider`` for a ``model: {hf: DIR}`` spec) import megatron,
Transformer Engine, mamba_ssm or Megatron-Bridge only when a GPU rank calls them.

Not run on a GPU yet: everything here past ``gpu_plan`` was written against megatron-core 0.16.1's source and
Megatron-Bridge 0.3.x's documented API (the import calls read the same in 0.4.2, 0.5.1 and 0.6.2:
``AutoBridge.from_hf_pretrained(path).to_megatron_provider(load_weights=False)``, ``provide(pre_process=,
post_process=, vp_stage=)``, ``finalize()`` from 0.4 on Mamba/Hybrid providers and 0.5 on every provider), and is
exercised only by scripts/gpu_check.sh on a real device.

FP8 recipe per capability where ``Layout.precision`` is bare fp8 (``fp8:<recipe>`` names its own; chosen here and
noted):
- fp8 on 8.9 (Ada) and 9.x (Hopper): ``delayed`` scaling, Megatron's long-standing default (format hybrid,
  amax history 1024 with max), the recipe most FP8 pretraining on Hopper has used.
- fp8 on 10.x / 12.x (Blackwell): ``tensorwise`` ("current scaling", Float8CurrentScaling): scales from the
  current tensor, no amax history to warm up, which suits a few-step smoke run; sweeper's choice, to be confirmed
  by scripts/gpu_check.sh on a Blackwell GPU.
- ``blockwise`` (Float8BlockScaling, DeepSeek-V3 style 1x128/128x128, format e4m3) only when asked for, on ≥ 9.0.
- mxfp8: MXFP8BlockScaling (format e4m3), compute capability 10.x only (docs/LAYOUT_RULES.md: rejected on 12.x too).
An explicit recipe is the precision's (fp8:delayed|fp8:tensorwise|fp8:blockwise), else the YAML's ``run.fp8_recipe``
(sweeper.config.run_settings), which the estimator and the exports read too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sweeper.backends.megatron.architecture import mamba_config_kwargs, mamba_model_builder, mla_config_kwargs
from sweeper.backends.megatron.device import capability_text
from sweeper.backends.megatron.failures import UnsupportedError
from sweeper.backends.megatron.layout_config import layout_config_kwargs
from sweeper.config import bridge_release
from sweeper.config.fusions import KERNELS, framework_fusions
from sweeper.config.kernels import Kernels
from sweeper.config.run_settings import (
    FP8_AMAX_COMPUTE_ALGO,
    FP8_AMAX_HISTORY_LEN,
    Framework,
    RunSettings,
    default_fp8_recipe,
    fp8_format,
)
from sweeper.models.spec import ModelSpec
from sweeper.space.axes import named_fp8_recipe, precision_dtype
from sweeper.space.layout import Layout

Capability = tuple[int, int]
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4"]
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "blockwise")
# catalog.resolve_model names a ``model: {hf: DIR}`` spec "hf:<absolute DIR>": the only field of ModelSpec that
# travels to the rank unchanged, so the GPU trial knows to build Megatron-Bridge's model from that folder.
HF_NAME_PREFIX = "hf:"
MAMBA_SLOW_PATH_NOTE = "Mamba fast path missing (no causal-conv1d): slow path"

class GpuPrecisionError(UnsupportedError, ValueError):
    """A precision or FP8 recipe the device's compute capability cannot run (docs/LAYOUT_RULES.md, precision); the
    trial reports it as unsupported (the cluster's declared compute capability let it through the rules)."""


@dataclass(frozen=True)
class GpuPlan:
    """What the GPU trial builds; plain values only (names of Megatron classes and functions, kwargs)."""

    model_class: Literal["GPTModel", "MambaModel"]
    config_class: Literal["TransformerConfig", "MLATransformerConfig"]
    # The layer spec: for GPTModel Megatron's get_gpt_decoder_block_spec(use_transformer_engine=True), which calls
    # get_gpt_layer_with_transformer_engine_spec with ``layer_spec_kwargs`` for the dense and the MoE layers;
    # for MambaModel megatron.core.models.mamba.mamba_layer_specs.mamba_stack_spec (TE modules throughout).
    layer_spec: str
    layer_spec_kwargs: dict[str, Any]
    # Extra TransformerConfig kwargs, disjoint from the ones build.transformer_config passes itself.
    config_kwargs: dict[str, Any]
    fp8_recipe: Fp8Recipe | None
    notes: tuple[str, ...] = field(default=())
    # TransformerConfig's fusion fields as the run's framework turns them on (sweeper.config.fusions), less those
    # whose kernel is missing on this device (noted).
    fusions: dict[str, bool] = field(default_factory=dict)


# Transformer Engine's blockwise FP8 GEMMs need CUDA 12.9 (its check_fp8_block_scaling_support).
BLOCKWISE_MIN_CUDA = (12, 9)


def cuda_version(text: str | None) -> tuple[int, int] | None:
    """torch.version.cuda ("12.8") as (12, 8); None for a CPU build."""
    if not text:
        return None
    major, _, minor = text.partition(".")
    return int(major), int(minor.partition(".")[0] or 0)


def fp8_precision_kwargs(precision: str, capability: Capability, recipe: str | None = None,
                         cuda: tuple[int, int] | None = None
                         ) -> tuple[dict[str, Any], Fp8Recipe | None, str | None]:
    """(TransformerConfig FP8 kwargs, recipe, note) for ``precision`` on a device of ``capability``.

    BF16/FP16/FP32 need no FP8 kwargs. Raises GpuPrecisionError where the capability cannot run the request."""
    cc = capability_text(capability)
    # ``recipe`` (run.fp8_recipe) is only what a bare fp8 means: MXFP8 and NVFP4 have their own whatever it says, so
    # one sweep compares fp8 under the run's recipe with them (issue 52).
    if precision == "mxfp8":
        if capability[0] != 10:
            raise GpuPrecisionError(
                f"MXFP8 needs compute capability 10.x (B200/GB200); Transformer Engine rejects it on {cc}"
            )
        return dict(fp8="e4m3", fp8_recipe="mxfp8"), "mxfp8", "precision mxfp8: MXFP8BlockScaling (e4m3)"
    if precision == "nvfp4":
        if capability[0] != 10:
            raise GpuPrecisionError(f"NVFP4 needs compute capability 10.x (B200/GB200/B300); this GPU is {cc}")
        # megatron-core's fp4 / fp4_recipe (transformer_config.py); fp4_utils.get_fp4_recipe builds TE's
        # NVFP4BlockScaling and raises itself below TE 2.7.
        return dict(fp4="e2m1", fp4_recipe="nvfp4"), "nvfp4", "precision nvfp4: NVFP4BlockScaling (e2m1)"
    if precision_dtype(precision) != "fp8":
        return {}, None, None
    recipe = named_fp8_recipe(precision) or recipe  # fp8:<recipe> names its own; bare fp8 takes run.fp8_recipe
    if capability < (8, 9):
        raise GpuPrecisionError(f"FP8 needs compute capability >= 8.9 (Ada/Hopper/Blackwell); this GPU is {cc}")
    chosen = recipe or default_fp8_recipe(capability[0])
    if chosen not in FP8_RECIPES:
        raise GpuPrecisionError(f"unknown FP8 recipe {chosen!r} (known: {', '.join(FP8_RECIPES)})")
    if chosen == "blockwise" and capability < (9, 0):
        raise GpuPrecisionError(f"FP8 blockwise scaling needs compute capability >= 9.0; this GPU is {cc}")
    if chosen == "blockwise" and cuda is not None and cuda < BLOCKWISE_MIN_CUDA:
        raise GpuPrecisionError(f"FP8 blockwise scaling needs CUDA >= 12.9 in Transformer Engine; this torch is "
                                f"built for CUDA {cuda[0]}.{cuda[1]}")
    if chosen == "delayed":
        kwargs: dict[str, Any] = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=FP8_AMAX_HISTORY_LEN,
                                      fp8_amax_compute_algo=FP8_AMAX_COMPUTE_ALGO)
    elif chosen == "tensorwise":
        kwargs = dict(fp8="hybrid", fp8_recipe="tensorwise")
    else:
        kwargs = dict(fp8=fp8_format(chosen), fp8_recipe="blockwise")
    how = "requested" if recipe else f"default for compute capability {cc}"
    return kwargs, chosen, f"precision fp8: recipe {chosen} ({how}), format {kwargs['fp8']}"  # type: ignore[return-value]


def gpu_unsupported_reason(spec: ModelSpec, layout: Layout, *, kernels: Kernels | None = None
                           ) -> tuple[str, str] | None:
    """(feature, why) the GPU+TE backend cannot run, or None. support.unsupported_reason formats it. ``kernels``:
    what the GPU nodes have (the driver asks them, sweeper.cluster.node_kernels); None: this machine's, as on a
    rank."""
    kernels = kernels or Kernels.here()
    if spec.is_hybrid and not kernels.mamba_ssm:
        return ("hybrid Mamba model (hybrid_layer_pattern)",
                "Megatron's MambaMixer needs the mamba_ssm package (pip install mamba-ssm causal-conv1d)")
    if layout.dispatcher == "flex" and not kernels.deep_ep:
        return (f"moe_token_dispatcher {layout.moe_token_dispatcher}",
                "the flex dispatcher needs DeepEP (deep_ep; HybridEP is its hybrid-ep branch) on the GPU nodes")
    if layout.cuda_graph == "full_iteration" or layout.cuda_graph_impl == "transformer_engine":
        # Megatron-LM's train loop captures these itself (FullCudaGraphWrapper around the schedule,
        # TECudaGraphHelper.create_cudagraphs after the warm-up steps); the smoke run does not yet, so its layers
        # would run eagerly while the trial recorded them as graphed. Local (per-layer) graphs are captured by
        # megatron-core's schedules themselves.
        return (f"cuda_graph {layout.cuda_graph}",
                "the smoke run does not capture full-iteration or Transformer Engine CUDA graphs yet (Megatron-LM's "
                "training loop does), so the trial would measure eager layers; cuda_graph: local is measured")
    release = bridge_release.target()
    if (layout.cuda_graph == "local" and bridge_source(spec) is not None
            and bridge_release.refuses_local_layer_graphs(release)):
        return (f"cuda_graph local with Megatron-Bridge {release} (model: {{hf: DIR}})",
                "Bridge's provide() refuses cuda_graph_impl=local other than full-iteration graphs from "
                f"{bridge_release.LOCAL_LAYER_GRAPHS_REFUSED_FROM}")
    if spec.multi_latent_attention and layout.cp > 1 and layout.is_fp8:
        return (f"FP8 multi_latent_attention with context parallel (cp={layout.cp})",
                "Transformer Engine's MLA context-parallel attention has no FP8 path")
    return None


def gpu_plan(
    spec: ModelSpec,
    layout: Layout,
    capability: Capability,
    *,
    fp8_recipe: str | None = None,
    causal_conv1d: bool = True,
    cuda: tuple[int, int] | None = None,
    framework: Framework = "megatron-core",
    missing_kernels: frozenset[str] = frozenset(),
) -> GpuPlan:
    """The GPU trial's model class, config class, TE layer spec choice and extra TransformerConfig kwargs.

    Pure: ``capability`` is the device's (torch.cuda.get_device_capability()), ``causal_conv1d`` whether the
    causal-conv1d kernels import, ``cuda`` the CUDA version torch was built for (None: not checked),
    ``framework`` the run's (its fusions; megatron-core's are all off), ``missing_kernels`` the fusions whose kernel
    does not import here (fusion_kernels_missing). Raises GpuPrecisionError (unsupported, before anything is built)
    when the precision cannot run on this device."""
    kwargs, recipe, note = fp8_precision_kwargs(layout.precision, capability, fp8_recipe, cuda)
    notes: list[str] = [note] if note else []
    fusions = framework_fusions(framework, spec)
    for name in sorted(missing_kernels):
        if fusions.get(name):
            fusions[name] = False
            notes.append(f"{name} off: {KERNELS[name]} does not import on this node")
    if layout.cp > 1:
        # TE's attention does the CP exchange; MLA supports only p2p (or a2a+p2p), so p2p for every model.
        kwargs["cp_comm_type"] = "p2p"
    if spec.is_hybrid:
        kwargs.update(mamba_config_kwargs(spec))
        if not causal_conv1d:
            # The memory-efficient path is mamba_ssm's fused conv1d+scan, which calls causal-conv1d's kernel; the
            # other path falls back to torch's Conv1d (Megatron warns it is not tested for training).
            kwargs["use_mamba_mem_eff_path"] = False
            notes.append(MAMBA_SLOW_PATH_NOTE)
        return GpuPlan(
            model_class="MambaModel",
            config_class="TransformerConfig",
            layer_spec="megatron.core.models.mamba.mamba_layer_specs.mamba_stack_spec",
            layer_spec_kwargs={"hybrid_override_pattern": spec.hybrid_layer_pattern,
                               "d_conv": spec.mamba_conv_kernel},
            config_kwargs=kwargs,
            fp8_recipe=recipe,
            notes=tuple(notes),
            fusions=fusions,
        )
    config_class: Literal["TransformerConfig", "MLATransformerConfig"] = "TransformerConfig"
    if spec.multi_latent_attention:
        config_class = "MLATransformerConfig"
        kwargs.update(mla_config_kwargs(spec))
    return GpuPlan(
        model_class="GPTModel",
        config_class=config_class,
        layer_spec="get_gpt_decoder_block_spec(use_transformer_engine=True) -> "
                   "get_gpt_layer_with_transformer_engine_spec",
        layer_spec_kwargs=dict(
            num_experts=spec.num_moe_experts,
            moe_grouped_gemm=spec.is_moe,
            qk_layernorm=spec.qk_layernorm,
            multi_latent_attention=spec.multi_latent_attention,
        ),
        config_kwargs=kwargs,
        fp8_recipe=recipe,
        notes=tuple(notes),
        fusions=fusions,
    )


def run_config_kwargs(layout: Layout, run: RunSettings, capability: str | None) -> dict[str, Any]:
    """TransformerConfig fields the GPU trial takes from the run settings and the knobs, as Megatron-LM derives
    them from its flags: ``fp8_param`` from --fp8-param-gather (core_transformer_config_from_args), and TE's RNG
    tracker under a CUDA graph (validate_args turns --te-rng-tracker on; megatron-core's CudaGraphManager asserts
    a graph-safe tracker)."""
    out: dict[str, Any] = {}
    if run.fp8_params(layout.precision, capability, distributed_optimizer=layout.distributed_optimizer):
        out["fp8_param"] = True
    if layout.cuda_graph != "none":
        out["use_te_rng_tracker"] = True
    return out


# -- the device and its optional kernels (cheap; no CUDA call) ---------------------------------------------------
def module_imports(name: str) -> bool:
    """True when ``name`` really imports (a CUDA extension built for another torch fails here, not in find_spec)."""
    try:
        __import__(name)
    except Exception:  # noqa: BLE001 - extension modules raise OSError/RuntimeError as well as ImportError
        return False
    return True


def device_plan(spec: ModelSpec, layout: Layout, run: RunSettings) -> GpuPlan:
    """gpu_plan for this process's current CUDA device under the run settings. Not run on a GPU yet."""
    import torch

    from sweeper.backends.megatron.device import compute_capability

    capability = compute_capability()
    if capability is None:
        raise RuntimeError("the GPU plan needs a CUDA device")
    return gpu_plan(spec, layout, capability, fp8_recipe=None if run.fp8_recipe == "auto" else run.fp8_recipe,
                    causal_conv1d=not spec.is_hybrid or module_imports("causal_conv1d"),
                    cuda=cuda_version(torch.version.cuda), framework=run.framework,
                    missing_kernels=fusion_kernels_missing())


def fusion_kernels_missing() -> frozenset[str]:
    """The fusions (sweeper.config.fusions.KERNELS) whose kernel does not import in this process: apex's
    fused_weight_gradient_mlp_cuda, the check megatron-core's ColumnParallelLinear and Bridge's
    can_enable_gradient_accumulation_fusion make; TE's fused RoPE, as rope_utils imports it (TransformerConfig
    checks the same names)."""
    from megatron.core.models.common.embeddings import rope_utils

    missing = set()
    if not module_imports("fused_weight_gradient_mlp_cuda"):
        missing.add("gradient_accumulation_fusion")
    if rope_utils.fused_apply_rotary_pos_emb is None and rope_utils.fused_apply_rotary_pos_emb_thd is None:
        missing.add("apply_rope_fusion")
    return frozenset(missing)


# -- Megatron-Bridge (model: {hf: DIR}) --------------------------------------------------------------------------
def bridge_source(spec: ModelSpec) -> Path | None:
    """The local Hugging Face folder of a ``model: {hf: DIR}`` spec; None for any other spec."""
    return Path(spec.name[len(HF_NAME_PREFIX):]) if spec.name.startswith(HF_NAME_PREFIX) else None


class BridgeMissingError(UnsupportedError, RuntimeError):
    """Megatron-Bridge is not installed where a ``model: {hf: DIR}`` trial runs."""


def bridge_missing_message(what: str) -> str:
    return (f"{what} needs Megatron-Bridge, which is not installed (pip install -e '.[bridge]' installs "
            f"{bridge_release.install_hint()}); for planning alone use model: {{hf_config: DIR}}")


# What Bridge's provider takes from the device plan: the precision recipe, TE's CP exchange, the Mamba path; the
# plan's MLA and Mamba architecture fields stay Bridge's own.
_PLAN_KEYS_FOR_BRIDGE = ("fp8", "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp4", "fp4_recipe",
                         "cp_comm_type", "use_mamba_mem_eff_path")


def bridge_overrides(spec: ModelSpec, layout: Layout, plan: GpuPlan, run: RunSettings,
                     capability: str | None) -> dict[str, Any]:
    """TransformerConfig fields sweeper sets on Bridge's provider: everything the layout decides (the same
    layout_config_kwargs a preset's GPU trial takes: parallel sizes, split, dtype, recompute, knobs, dispatcher),
    the device plan's precision recipe and the run settings' FP8 weights and graph-safe RNG.

    The architecture (and everything else) stays Bridge's, so the trial builds exactly Bridge's model."""
    out = layout_config_kwargs(spec, layout, cuda=True)
    out.update({k: v for k, v in plan.config_kwargs.items() if k in _PLAN_KEYS_FOR_BRIDGE})
    out.update(plan.fusions)  # the Bridge export sets them too (sweeper.config.fusions)
    out.update(run_config_kwargs(layout, run, capability))
    return out


def bridge_provider(spec: ModelSpec, layout: Layout, plan: GpuPlan, run: RunSettings) -> Any:
    """Megatron-Bridge's model provider for the spec's local HF folder, with the layout applied and finalized.

    The provider is a TransformerConfig subclass: build.py uses it as the config (DDP, optimizer) and calls
    ``provider.provide(pre_process=, post_process=, vp_stage=)`` per model chunk. No weights are loaded (a smoke run
    trains from random initialisation) and nothing is downloaded. Not run on a GPU yet."""
    source = bridge_source(spec)
    if source is None:
        raise ValueError(f"model {spec.name!r} was not given as model: {{hf: DIR}}")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        from megatron.bridge import AutoBridge
    except ImportError as exc:
        raise BridgeMissingError(bridge_missing_message(f"model: {{hf: {source}}}") + f" ({exc})") from None

    provider = AutoBridge.from_hf_pretrained(str(source)).to_megatron_provider(load_weights=False)
    from sweeper.backends.megatron.device import device_capability_text

    overrides = bridge_overrides(spec, layout, plan, run, device_capability_text())
    for name, value in overrides.items():
        setattr(provider, name, value)
    finalize = getattr(provider, "finalize", None)
    if callable(finalize):  # newer Bridge validates here (TransformerConfig.__post_init__ with the layout applied)
        finalize()
    return provider


# -- model builders for build.py ---------------------------------------------------------------------------------
def gpu_model(spec: ModelSpec, layout: Layout, config: Any, run: RunSettings) -> tuple[Any, Callable[..., Any]]:
    """(config, model class) for build.py on a GPU with TE: Bridge's provider and its ``provide`` for a
    ``model: {hf: DIR}`` spec; otherwise build.py's config and GPTModel or the MambaModel builder. Not run on a GPU
    yet."""
    plan = device_plan(spec, layout, run)
    if bridge_source(spec) is not None:
        provider = bridge_provider(spec, layout, plan, run)
        return provider, gpu_model_class(spec, plan, provider)
    return config, gpu_model_class(spec, plan)


def config_class(plan: GpuPlan) -> type:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig if plan.config_class == "MLATransformerConfig" else TransformerConfig


def gpu_model_class(spec: ModelSpec, plan: GpuPlan, provider: Any = None) -> Callable[..., Any]:
    """A callable with GPTModel's keyword arguments that builds the GPU model chunk: GPTModel with the TE block
    spec build.py computed, MambaModel with mamba_stack_spec, or Bridge's ``provider.provide``. Not run on a GPU yet."""
    if provider is not None:
        def bridge_chunk(*, pre_process: bool, post_process: bool, vp_stage: int | None, **_: Any) -> Any:
            return provider.provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

        return bridge_chunk
    if plan.model_class == "GPTModel":
        from megatron.core.models.gpt import GPTModel

        return GPTModel

    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    return mamba_model_builder(spec, mamba_stack_spec)
