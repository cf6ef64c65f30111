"""The GPU trial's kernel fusions (issue 44, item 8), without CUDA: the run's framework's fusions in the device plan,
a fusion whose kernel is missing turned off with a note, and the CPU backend's config without any."""

from __future__ import annotations

from sweeper.backends.megatron import build, gpu
from sweeper.config.fusions import FUSIONS
from sweeper.config.run_settings import RunSettings
from sweeper.models.catalog import preset
from sweeper.space.layout import Layout

HOPPER = (9, 0)


def test_the_plan_carries_the_frameworks_fusions() -> None:
    spec, layout = preset("tiny-gpt"), Layout(world_size=1)
    lm = gpu.gpu_plan(spec, layout, HOPPER, framework="megatron-lm")
    assert lm.fusions["gradient_accumulation_fusion"] is True and lm.fusions["cross_entropy_loss_fusion"] is False
    assert gpu.gpu_plan(spec, layout, HOPPER, framework="megatron-bridge").fusions["cross_entropy_loss_fusion"]
    assert lm.notes == ()


def test_a_fusion_without_its_kernel_is_off_and_noted() -> None:
    """Megatron-LM would raise in ColumnParallelLinear without apex's fused_weight_gradient_mlp_cuda; the trial runs
    without the fusion and says so (Bridge turns it off itself)."""
    plan = gpu.gpu_plan(preset("tiny-gpt"), Layout(world_size=1), HOPPER, framework="megatron-lm",
                        missing_kernels=frozenset({"gradient_accumulation_fusion"}))
    assert plan.fusions["gradient_accumulation_fusion"] is False and plan.fusions["apply_rope_fusion"] is True
    assert plan.notes == ("gradient_accumulation_fusion off: apex's fused_weight_gradient_mlp_cuda does not import "
                          "on this node",)
    core = gpu.gpu_plan(preset("tiny-gpt"), Layout(world_size=1), HOPPER, framework="megatron-core",
                        missing_kernels=frozenset({"gradient_accumulation_fusion"}))
    assert core.notes == ()  # nothing turned off: megatron-core never turned it on


def test_the_cpu_backend_runs_no_fusion_whatever_the_framework() -> None:
    config = build.transformer_config(preset("tiny-gpt"), Layout(world_size=1), cuda=False, te=False,
                                      run=RunSettings(framework="megatron-bridge"))
    assert not any(getattr(config, f.field) for f in FUSIONS)
