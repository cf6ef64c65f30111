"""Run settings (the YAML's ``run:``, issue 13): framework defaults, checks, exports, and where they reach."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from sweeper.backends.megatron.support import run_unsupported_reason
from sweeper.config.load import load_config
from sweeper.config.run_settings import RunSettings

ROOT = Path(__file__).resolve().parents[2]


def test_each_framework_fills_what_the_yaml_leaves_out() -> None:
    lm, bridge, core = RunSettings(), RunSettings(framework="megatron-bridge"), RunSettings(framework="megatron-core")
    assert (lm.grads_in_fp32, bridge.grads_in_fp32, core.grads_in_fp32) == (True, True, False)
    assert (lm.overlaps_grad_reduce, bridge.overlaps_grad_reduce, core.overlaps_grad_reduce) == (False, True, False)
    assert (lm.fp8_params("fp8", "9.0", distributed_optimizer=True),
            bridge.fp8_params("fp8", "9.0", distributed_optimizer=True)) == (False, True)
    assert bridge.fp8_params("bf16", "9.0", distributed_optimizer=True) is False  # no FP8, no FP8 weights
    offload = {"optimizer_cpu_offload": True, "precision_aware_optimizer": True}
    # Offload without a fraction offloads the whole shard in every framework (Bridge's own 0.0 would move nothing).
    for framework in ("megatron-lm", "megatron-bridge", "megatron-core"):
        assert RunSettings(framework=framework, **offload).offloaded_fraction == 1.0
    assert RunSettings(grad_reduce_in_fp32=False, framework="megatron-bridge").grads_in_fp32 is False


def test_grad_buffer_dtype_per_precision() -> None:
    run = RunSettings(grad_reduce_in_fp32=False)
    assert [run.grad_buffer_fp32(p) for p in ("fp32", "fp16", "bf16", "fp8", "mxfp8")] == [True, False, False,
                                                                                          False, False]
    assert RunSettings().grad_buffer_fp32("bf16") is True


def test_recipe_follows_the_device_unless_named() -> None:
    assert RunSettings().recipe("fp8", "9.0") == "delayed"
    assert RunSettings().recipe("fp8", "12.0") == "tensorwise"
    assert RunSettings(fp8_recipe="blockwise").recipe("fp8", "9.0") == "blockwise"
    assert RunSettings().recipe("mxfp8", "10.0") == "mxfp8" and RunSettings().recipe("bf16", "9.0") is None
    # A precision that names its recipe wins over run.fp8_recipe and the device's default.
    for recipe in ("delayed", "tensorwise", "blockwise"):
        assert RunSettings(fp8_recipe="blockwise").recipe(f"fp8:{recipe}", "9.0") == recipe
        assert RunSettings().recipe(f"fp8:{recipe}", "10.0") == recipe


def test_inconsistent_settings_are_refused_with_megatrons_words() -> None:
    with pytest.raises(ValidationError, match="need precision_aware_optimizer"):
        RunSettings(exp_avg_dtype="bf16")
    with pytest.raises(ValidationError, match="requires --overlap-grad-reduce"):
        RunSettings(overlap_param_gather=True, overlap_grad_reduce=False)
    # Megatron-LM's validate_args: "The optimizer cpu offload must be used in conjunction with
    # `--use-precision-aware-optimizer`"; a fraction of 0 would offload nothing.
    with pytest.raises(ValidationError, match="in conjunction with `--use-precision-aware-optimizer`"):
        RunSettings(optimizer_cpu_offload=True)
    with pytest.raises(ValidationError, match="offloads nothing"):
        RunSettings(optimizer_cpu_offload=True, precision_aware_optimizer=True, optimizer_offload_fraction=0)


def test_offload_is_exported_as_offloaded_in_both_frameworks() -> None:
    """Issue 52: Bridge exports wrote optimizer_offload_fraction=0 (Bridge's default), offloading nothing."""
    for framework in ("megatron-lm", "megatron-bridge"):
        run = RunSettings(framework=framework, optimizer_cpu_offload=True, precision_aware_optimizer=True)
        assert "optimizer.optimizer_offload_fraction=1" in run.bridge_overrides("bf16", "9.0")
        assert "--optimizer-offload-fraction=1" in run.megatron_args("bf16", "9.0")


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_each_named_recipe_exports_its_own_flags(recipe: str) -> None:
    """fp8:<recipe> writes that recipe's --fp8-recipe / format whatever run.fp8_recipe says, and every layer FP8 in
    Bridge (its current-scaling recipe would keep the first and last layer in BF16)."""
    run = RunSettings(fp8_recipe="delayed" if recipe != "delayed" else "tensorwise")
    args = run.megatron_args(f"fp8:{recipe}", "9.0")
    assert f"--fp8-recipe={recipe}" in args
    assert ("--fp8-amax-history-len=1024" in args) == (recipe == "delayed")
    overrides = run.bridge_overrides(f"fp8:{recipe}", "9.0")
    assert f"mixed_precision.fp8_recipe={recipe}" in overrides
    assert "mixed_precision.first_last_layers_bf16=false" in overrides


def test_exports_carry_the_settings_as_megatron_flags_and_bridge_overrides() -> None:
    run = RunSettings(framework="megatron-bridge", grad_reduce_in_fp32=False, precision_aware_optimizer=True,
                      exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    args = run.megatron_args("fp8", "9.0")
    assert args[:6] == ["--fp8-format=hybrid", "--fp8-recipe=delayed", "--fp8-amax-history-len=1024",
                        "--fp8-amax-compute-algo=max", "--grad-reduce-in-bf16", "--fp8-param-gather"]
    # Delayed scaling's amax history as the trial runs it (gpu.fp8_precision_kwargs), not the frameworks' 1 /
    # most_recent; the current-scaling recipes keep none (issue 44, item 9).
    assert {"mixed_precision.fp8_amax_history_len=1024", "mixed_precision.fp8_amax_compute_algo=max"} <= set(
        run.bridge_overrides("fp8", "9.0"))
    assert not any("amax" in a for a in RunSettings(fp8_recipe="tensorwise").megatron_args("fp8", "9.0"))
    assert "--exp-avg-dtype=bf16" in args and "--overlap-grad-reduce" in args and "--overlap-param-gather" in args
    # The block-scaled recipe is E4M3 throughout, in the trial (gpu.py) as in both exports.
    assert RunSettings(fp8_recipe="blockwise").megatron_args("fp8", "9.0")[:2] == [
        "--fp8-format=e4m3", "--fp8-recipe=blockwise"]
    assert "mixed_precision.fp8=e4m3" in RunSettings(fp8_recipe="blockwise").bridge_overrides("fp8", "9.0")
    # The param-gather overlap is the distributed optimizer's: without it neither export asks for it.
    assert "--overlap-param-gather" not in run.megatron_args("fp8", "9.0", distributed_optimizer=False)
    assert "ddp.overlap_param_gather=false" in run.bridge_overrides("fp8", "9.0", distributed_optimizer=False)
    overrides = run.bridge_overrides("fp8", "9.0")
    for expected in ("mixed_precision.grad_reduce_in_fp32=false", "ddp.grad_reduce_in_fp32=false",
                     "mixed_precision.fp8_param_gather=true", "optimizer.exp_avg_dtype=torch.bfloat16",
                     "ddp.overlap_grad_reduce=true"):
        assert expected in overrides
    assert RunSettings().megatron_args("bf16", "9.0") == []  # Megatron-LM's defaults need no flag


def test_the_cpu_backend_refuses_what_only_a_gpu_builds() -> None:
    assert run_unsupported_reason(RunSettings(), cuda=False, te=False) is None
    reason = run_unsupported_reason(RunSettings(precision_aware_optimizer=True), cuda=False, te=False)
    assert reason and reason.startswith("run.precision_aware_optimizer unsupported on this backend")
    assert run_unsupported_reason(RunSettings(precision_aware_optimizer=True), cuda=True, te=True) is None


def test_a_yaml_run_section_reaches_the_estimator(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "search_spaces" / "quickstart.yaml").read_text())
    data["run"] = {"framework": "megatron-core"}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert cfg.run.framework == "megatron-core" and cfg.run.grads_in_fp32 is False
    data["run"] = {"framework": "megatron-lm", "grad_dtype": "bf16"}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match="run.grad_dtype"):
        load_config(path)


def test_flagship_spaces_name_their_framework() -> None:
    for name in ("nemotron.yaml", "deepseek_v2_lite.yaml"):
        run = load_config(ROOT / "search_spaces" / name).run
        assert run.framework == "megatron-bridge" and run.grads_in_fp32 is False


@pytest.mark.parametrize("run", [RunSettings(framework="megatron-bridge"), RunSettings(fp8_param_gather=True)],
                         ids=["bridge-default", "explicit"])
def test_fp8_parameters_only_with_the_distributed_optimizer(run: RunSettings) -> None:
    """Megatron-LM's validate_args asserts '--fp8-param-gather only supported with distributed optimizer, ...'
    (arguments.py, core_v0.16.1): a layout without it keeps BF16 weights in the estimate and both exports, as
    --overlap-param-gather is left out there (issue 44 item 12)."""
    from sweeper.config.estimator import EstimatorConstants
    from sweeper.estimate.memory import fp8_weight_bytes

    assert run.fp8_params("fp8", "9.0", distributed_optimizer=True) is True
    assert run.fp8_params("fp8", "9.0", distributed_optimizer=False) is False
    assert "--fp8-param-gather" in run.megatron_args("fp8", "9.0", distributed_optimizer=True)
    assert "--fp8-param-gather" not in run.megatron_args("fp8", "9.0", distributed_optimizer=False)
    overrides = set(run.bridge_overrides("fp8", "9.0", distributed_optimizer=False))
    assert {"mixed_precision.fp8_param_gather=false", "ddp.fp8_param_gather=false"} <= overrides
    mxfp8 = run.model_copy(update={"fp8_param_gather": True})
    assert mxfp8.reuses_grad_buffer("mxfp8", "10.0", fsdp=False, distributed_optimizer=True) is True
    assert mxfp8.reuses_grad_buffer("mxfp8", "10.0", fsdp=False, distributed_optimizer=False) is False
    assert "--reuse-grad-buf-for-mxfp8-param-ag" not in mxfp8.megatron_args("mxfp8", "10.0",
                                                                             distributed_optimizer=False)
    constants = EstimatorConstants()
    bf16_weights = fp8_weight_bytes("fp8", constants, "9.0", RunSettings(fp8_param_gather=False))
    assert fp8_weight_bytes("fp8", constants, "9.0", run, distributed_optimizer=False) == bf16_weights
    assert fp8_weight_bytes("fp8", constants, "9.0", run) != bf16_weights
