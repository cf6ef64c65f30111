"""MXFP8 with FP8 parameters (issue 44, item 10), without CUDA: the trial's DDP and optimizer configs reuse the grad
buffer for the weights' all-gather as Bridge asserts (MixedPrecisionConfig.finalize), and both exports ask for it.
What only a B200 can show (the all-gather through the reused buffer, Built.refill_param_buffer) is
scripts/gpu_check.sh's."""

from __future__ import annotations

from unittest import mock

import pytest

from sweeper.backends.megatron import build, device
from sweeper.config.run_settings import RunSettings
from sweeper.space.layout import Layout

B200 = (10, 0)
MXFP8 = Layout(world_size=2, precision="mxfp8", distributed_optimizer=True)


@pytest.fixture
def b200():
    with mock.patch.object(device, "compute_capability", lambda: B200):
        yield


def test_bridge_mxfp8_weights_reuse_the_grad_buffer_in_ddp_and_the_optimizer(b200: None) -> None:
    run = RunSettings(framework="megatron-bridge")  # FP8 weights by default, overlapped gathers
    ddp = build.ddp_config(MXFP8, run, cuda=True, te=True)
    assert ddp.fp8_param_gather is True and ddp.reuse_grad_buf_for_mxfp8_param_ag is True
    optimizer = build.optimizer_config(MXFP8, run, te=True)
    assert optimizer.reuse_grad_buf_for_mxfp8_param_ag is True
    # Megatron-LM copies these by name too: the optimizer leaves the main-param copy to the loop under the overlap.
    assert optimizer.fp8_recipe == "mxfp8" and optimizer.overlap_param_gather is True


def test_no_reuse_without_fp8_weights_megatron_fsdp_or_the_gpu(b200: None) -> None:
    lm = RunSettings()  # Megatron-LM gathers BF16 weights by default
    assert build.ddp_config(MXFP8, lm, cuda=True, te=True).reuse_grad_buf_for_mxfp8_param_ag is False
    assert build.optimizer_config(MXFP8, lm, te=True).reuse_grad_buf_for_mxfp8_param_ag is False
    bridge = RunSettings(framework="megatron-bridge")
    fsdp = Layout(world_size=2, precision="mxfp8", distributed_optimizer=True, fsdp="optim")
    assert build.ddp_config(fsdp, bridge, cuda=True, te=True).reuse_grad_buf_for_mxfp8_param_ag is False
    assert build.ddp_config(MXFP8, bridge, cuda=False, te=False).reuse_grad_buf_for_mxfp8_param_ag is False
    assert build.optimizer_config(MXFP8, bridge).fp8_recipe is None  # the CPU backend runs no FP8


def test_the_exports_ask_for_what_the_trial_runs() -> None:
    bridge = RunSettings(framework="megatron-bridge")
    assert "--reuse-grad-buf-for-mxfp8-param-ag" in bridge.megatron_args("mxfp8", "10.0")
    assert "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true" in bridge.bridge_overrides("mxfp8", "10.0")
    # FP8 weights off: Bridge's bf16_with_mxfp8_mixed recipe turns reuse on, and DDP's config asserts FP8 weights
    # with it, so the export turns it off explicitly.
    assert "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false" in RunSettings().bridge_overrides("mxfp8", "10.0")
    assert "--reuse-grad-buf-for-mxfp8-param-ag" not in RunSettings().megatron_args("mxfp8", "10.0")
    assert "--reuse-grad-buf-for-mxfp8-param-ag" not in bridge.megatron_args("mxfp8", "10.0", fsdp=True)
