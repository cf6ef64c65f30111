"""Run settings that move memory: the YAML's ``run:`` section, shared by the estimator, the smoke run and the exports.

A layout does not say everything that decides a rank's memory: the grad buffer's dtype, the optimizer's moment
dtypes and CPU offload, FP8 weights in the parameter buffer. Their defaults differ between the frameworks a user
trains with, so ``framework`` names the framework and every setting left out (``null``) takes that framework's
default (read from the source of the versions sweeper pins: megatron-core 0.16.1, Megatron-LM core_v0.16.1,
Megatron-Bridge 0.3.1; the Bridge defaults below read the same in 0.4.2, 0.5.1 and 0.6.2, where the mxfp8 assertion
moved from MixedPrecisionConfig.finalize to ConfigContainer.validate in 0.5):

- ``grad_reduce_in_fp32`` (FP32 main grads under BF16): Megatron-LM with ``--bf16`` turns
  ``accumulate_allreduce_grads_in_fp32`` on unless ``--grad-reduce-in-bf16`` (arguments.py validate_args);
  Bridge's ``MixedPrecisionConfig.grad_reduce_in_fp32 = True`` (training/mixed_precision.py; it overwrites
  ``ddp.grad_reduce_in_fp32``); megatron-core's ``DistributedDataParallelConfig.grad_reduce_in_fp32 = False``.
- ``fp8_param_gather``: off in Megatron-LM and megatron-core; on in Bridge's FP8 recipes except blockwise
  (bf16_with_fp8_delayed_scaling_mixed, ..._current_scaling_mixed, bf16_with_mxfp8_mixed); only with the
  distributed optimizer (Megatron-LM asserts it), off in a layout without it.
- MXFP8 with FP8 parameters gathers them through the grad buffer (``reuse_grad_buf_for_mxfp8_param_ag``) in every
  framework: Bridge's ``MixedPrecisionConfig.finalize`` asserts it, megatron-core's OptimizerConfig warns of the
  memory without it, and Megatron-LM's opt-in ``--reuse-grad-buf-for-mxfp8-param-ag`` is exported (issue 44).
- ``overlap_grad_reduce`` / ``overlap_param_gather``: off in Megatron-LM and megatron-core, on in Bridge's
  pretrain recipes. No memory of their own (the all-gather is in place); they hide DP communication.
- ``optimizer_offload_fraction``: 1.0 in Megatron-LM (``--optimizer-offload-fraction``), 0.0 in megatron-core's
  OptimizerConfig and so in Bridge, where ``optimizer_cpu_offload`` alone moves nothing. sweeper takes
  ``optimizer_cpu_offload: true`` to mean offload: without a fraction it offloads the whole shard (Megatron-LM's
  1.0) in every framework, and writes the fraction in both exports (issue 52: Bridge exports wrote 0).
- ``optimizer_cpu_offload`` needs ``precision_aware_optimizer`` (Megatron-LM's validate_args: the hybrid device
  optimizer reuses its code path), refused here with Megatron's words; the layout-dependent refusals (the
  precision-aware optimizer without the distributed optimizer, offload with FP8 weights under a recipe other than
  delayed) are layout rules (plan/rules.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sweeper.space.axes import named_fp8_recipe, precision_dtype

Framework = Literal["megatron-lm", "megatron-bridge", "megatron-core"]
MomentDtype = Literal["fp32", "bf16", "fp16", "fp8"]
Fp8Recipe = Literal["auto", "delayed", "tensorwise", "blockwise"]
MOMENT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

_DEFAULTS: dict[str, dict[str, Any]] = {
    "megatron-lm": {"grad_reduce_in_fp32": True, "fp8_param_gather": False, "overlap": False},
    "megatron-bridge": {"grad_reduce_in_fp32": True, "fp8_param_gather": True, "overlap": True},
    "megatron-core": {"grad_reduce_in_fp32": False, "fp8_param_gather": False, "overlap": False},
}
# The optimizer shard's offloaded fraction under optimizer_cpu_offload when the YAML gives none (module docstring).
DEFAULT_OFFLOAD_FRACTION = 1.0


def default_fp8_recipe(compute_capability_major: int) -> str:
    """The FP8 recipe of precision fp8 when none is named: tensorwise (current scaling) on compute capability
    >= 10.0, delayed below. The estimator, the exports and the GPU smoke run (backends/megatron/gpu.py) all take it."""
    return "tensorwise" if compute_capability_major >= 10 else "delayed"


def fp8_format(recipe: str) -> str:
    """Megatron's --fp8-format for an FP8 recipe: E4M3 throughout for the block-scaled recipes (DeepSeek-V3's
    blockwise, MXFP8), hybrid (E4M3 forward, E5M2 gradients) for delayed and tensorwise scaling."""
    return "e4m3" if recipe in ("blockwise", "mxfp8") else "hybrid"


# Delayed scaling's amax history, as Megatron's long-standing FP8 runs and Bridge's
# bf16_with_fp8_delayed_scaling_mixed set it (megatron-core's TransformerConfig default is 1 / most_recent): the GPU
# trial runs it and the exports ask for it (issue 44, item 9).
FP8_AMAX_HISTORY_LEN = 1024
FP8_AMAX_COMPUTE_ALGO = "max"

# The MoE router's load balancing in the smoke run and the exports (Megatron's default type, GShard's coefficient).
MOE_LOAD_BALANCING_TYPE = "aux_loss"
MOE_AUX_LOSS_COEFF = 1e-2


class RunSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    framework: Framework = "megatron-lm"
    """What the production run trains with (megatron-lm, megatron-bridge, megatron-core): every setting left out
    takes its default."""
    grad_reduce_in_fp32: bool | None = None
    """FP32 main gradients under BF16/FP8 (Megatron-LM --grad-reduce-in-bf16 is false); null: the framework's
    default."""
    precision_aware_optimizer: bool = False
    """--use-precision-aware-optimizer (needs the distributed optimizer and TE's FusedAdam): Adam's moments in
    exp_avg_dtype / exp_avg_sq_dtype, the grads read in place instead of copied to FP32."""
    exp_avg_dtype: MomentDtype = "fp32"
    """Adam's first moment's dtype (--exp-avg-dtype), with precision_aware_optimizer."""
    exp_avg_sq_dtype: MomentDtype = "fp32"
    """Adam's second moment's dtype (--exp-avg-sq-dtype), with precision_aware_optimizer."""
    optimizer_cpu_offload: bool = False
    """--optimizer-cpu-offload: optimizer_offload_fraction of each rank's optimizer shard (master weights, moments)
    lives and steps on the host; needs precision_aware_optimizer (Megatron-LM asserts it)."""
    optimizer_offload_fraction: float | None = Field(None, ge=0, le=1)
    """--optimizer-offload-fraction, with optimizer_cpu_offload; null: 1.0, the whole shard (Megatron-LM's default;
    megatron-core's and Bridge's 0.0 would offload nothing)."""
    fp8_recipe: Fp8Recipe = "auto"
    """--fp8-recipe of a bare precision fp8 (delayed, tensorwise, blockwise); auto: tensorwise on compute capability
    >= 10.0, delayed below. Precisions fp8:<recipe> name their own; mxfp8 is always MXFP8."""
    fp8_param_gather: bool | None = None
    """--fp8-param-gather: FP8 weights, gathered in FP8; null: the framework's default."""
    overlap_grad_reduce: bool | None = None
    """--overlap-grad-reduce; null: the framework's default."""
    overlap_param_gather: bool | None = None
    """--overlap-param-gather; null: the framework's default."""

    @model_validator(mode="after")
    def _consistent(self) -> RunSettings:
        if not self.precision_aware_optimizer and (self.exp_avg_dtype, self.exp_avg_sq_dtype) != ("fp32", "fp32"):
            raise ValueError("exp_avg_dtype / exp_avg_sq_dtype other than fp32 need precision_aware_optimizer: true "
                             "(Megatron's --use-precision-aware-optimizer)")
        if self.optimizer_cpu_offload and not self.precision_aware_optimizer:
            raise ValueError("optimizer_cpu_offload needs precision_aware_optimizer: true (Megatron-LM: The optimizer "
                             "cpu offload must be used in conjunction with `--use-precision-aware-optimizer`)")
        if self.optimizer_cpu_offload and self.optimizer_offload_fraction == 0:
            raise ValueError("optimizer_offload_fraction 0 with optimizer_cpu_offload offloads nothing: give a "
                             "fraction > 0, or leave optimizer_cpu_offload out")
        if self.overlap_param_gather and self.overlap_grad_reduce is False:
            raise ValueError("overlap_param_gather needs overlap_grad_reduce (Megatron-LM: --overlap-param-gather "
                             "requires --overlap-grad-reduce)")
        return self

    # -- resolved values (the framework's default where the YAML says nothing) ---------------------------------------
    @property
    def grads_in_fp32(self) -> bool:
        value = self.grad_reduce_in_fp32
        return _DEFAULTS[self.framework]["grad_reduce_in_fp32"] if value is None else value

    def grad_buffer_fp32(self, precision: str) -> bool:
        """Whether DDP's grad buffer is FP32 for a run of ``precision``: FP32 runs are; FP16 keeps FP16 grads
        (neither framework turns FP32 accumulation on for it); BF16 and FP8/MXFP8 (BF16 weights) follow
        ``grad_reduce_in_fp32``."""
        if precision in ("fp32", "fp16"):
            return precision == "fp32"
        return self.grads_in_fp32

    def optimizer_kwargs(self) -> dict[str, Any]:
        """megatron.core.optimizer.OptimizerConfig fields for these settings (GPU path; the CPU backend refuses
        the precision-aware optimizer and CPU offload, ``sweeper.backends.megatron.support``)."""
        out: dict[str, Any] = {}
        if self.precision_aware_optimizer:
            import torch

            out.update(use_precision_aware_optimizer=True,
                       exp_avg_dtype=getattr(torch, _TORCH_DTYPE[self.exp_avg_dtype]),
                       exp_avg_sq_dtype=getattr(torch, _TORCH_DTYPE[self.exp_avg_sq_dtype]))
        if self.optimizer_cpu_offload:
            out.update(optimizer_cpu_offload=True, optimizer_offload_fraction=self.offloaded_fraction)
        return out

    def recipe(self, precision: str, compute_capability: str | None) -> str | None:
        """The FP8 recipe a run of ``precision`` uses on a device of ``compute_capability`` (None: not FP8): the one
        ``fp8:<recipe>`` names, else (bare ``fp8``) run.fp8_recipe, whose auto follows the compute capability."""
        if precision == "mxfp8":
            return "mxfp8"
        if precision_dtype(precision) != "fp8":
            return None
        if named := named_fp8_recipe(precision):
            return named
        if self.fp8_recipe != "auto":
            return self.fp8_recipe
        if compute_capability is None:
            return "delayed"
        return default_fp8_recipe(int(compute_capability.partition(".")[0]))

    def fp8_params(self, precision: str, compute_capability: str | None, *, distributed_optimizer: bool) -> bool:
        """Whether FP8/MXFP8 weights are stored and gathered in FP8 (--fp8-param-gather) in a layout with or without
        the distributed optimizer: only with it, as ``param_gather_overlap``. Megatron-LM's validate_args asserts
        "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or inference
        mode" (arguments.py, core_v0.16.1; sweeper's Megatron-FSDP needs the distributed optimizer too), and
        Bridge's FP8 recipes turn it on by default: a layout without the distributed optimizer keeps BF16 weights
        in the estimate, the trial and both exports, instead of a space losing those layouts."""
        recipe = self.recipe(precision, compute_capability)
        if recipe is None or not distributed_optimizer:
            return False
        if self.fp8_param_gather is not None:
            return self.fp8_param_gather
        return bool(_DEFAULTS[self.framework]["fp8_param_gather"]) and recipe != "blockwise"

    def reuses_grad_buffer(self, precision: str, compute_capability: str | None, *, fsdp: bool,
                           distributed_optimizer: bool) -> bool:
        """MXFP8 weights all-gathered through the grad buffer (reuse_grad_buf_for_mxfp8_param_ag): with FP8
        parameters under the MXFP8 recipe, which Bridge's MixedPrecisionConfig.finalize asserts and megatron-core's
        OptimizerConfig recommends (it warns of the extra memory without); Megatron-LM's opt-in flag is exported.
        Not with Megatron-FSDP (Bridge turns it off there)."""
        return (self.recipe(precision, compute_capability) == "mxfp8" and not fsdp
                and self.fp8_params(precision, compute_capability, distributed_optimizer=distributed_optimizer))

    @property
    def overlaps_grad_reduce(self) -> bool:
        value = self.overlap_grad_reduce
        return _DEFAULTS[self.framework]["overlap"] if value is None else value

    @property
    def overlaps_param_gather(self) -> bool:
        value = self.overlap_param_gather
        return self.overlaps_grad_reduce and (_DEFAULTS[self.framework]["overlap"] if value is None else value)

    def param_gather_overlap(self, distributed_optimizer: bool) -> bool:
        """overlap_param_gather for a layout: only with the distributed optimizer (Megatron-LM asserts it; the
        all-gather it overlaps is the distributed optimizer's)."""
        return self.overlaps_param_gather and distributed_optimizer

    @property
    def offloaded_fraction(self) -> float:
        """Fraction of the optimizer shard on the host (0 without optimizer_cpu_offload)."""
        if not self.optimizer_cpu_offload:
            return 0.0
        value = self.optimizer_offload_fraction
        return float(DEFAULT_OFFLOAD_FRACTION if value is None else value)

    @property
    def moment_bytes(self) -> float:
        """Bytes per parameter of Adam's two moments together (the offloaded part keeps FP32 moments on the host,
        hybrid_optimizer.py ignores the moment dtypes)."""
        return float(MOMENT_BYTES[self.exp_avg_dtype] + MOMENT_BYTES[self.exp_avg_sq_dtype])

    # -- exports -------------------------------------------------------------------------------------------------
    def megatron_args(self, precision: str, compute_capability: str | None, *,
                      distributed_optimizer: bool = True, fsdp: bool = False) -> list[str]:
        """Megatron-LM flags for these settings (beside the layout's ``Layout.megatron_args``)."""
        args: list[str] = []
        recipe = self.recipe(precision, compute_capability)
        if recipe is not None and precision_dtype(precision) == "fp8":
            args += [f"--fp8-format={fp8_format(recipe)}", f"--fp8-recipe={recipe}"]
        if recipe == "delayed":  # Megatron-LM's own defaults are 1 / most_recent
            args += [f"--fp8-amax-history-len={FP8_AMAX_HISTORY_LEN}",
                     f"--fp8-amax-compute-algo={FP8_AMAX_COMPUTE_ALGO}"]
        if precision_dtype(precision) in ("bf16", "fp8", "mxfp8") and not self.grad_buffer_fp32(precision):
            args.append("--grad-reduce-in-bf16")
        if self.fp8_params(precision, compute_capability, distributed_optimizer=distributed_optimizer):
            args.append("--fp8-param-gather")
        if self.reuses_grad_buffer(precision, compute_capability, fsdp=fsdp,
                                   distributed_optimizer=distributed_optimizer):
            args.append("--reuse-grad-buf-for-mxfp8-param-ag")
        if self.precision_aware_optimizer:
            args += ["--use-precision-aware-optimizer", f"--exp-avg-dtype={self.exp_avg_dtype}",
                     f"--exp-avg-sq-dtype={self.exp_avg_sq_dtype}"]
        if self.optimizer_cpu_offload:
            args += ["--optimizer-cpu-offload", f"--optimizer-offload-fraction={self.offloaded_fraction:g}"]
        if self.overlaps_grad_reduce:
            args.append("--overlap-grad-reduce")
        if self.param_gather_overlap(distributed_optimizer):
            args.append("--overlap-param-gather")
        return args

    def bridge_overrides(self, precision: str, compute_capability: str | None, *,
                         distributed_optimizer: bool = True, fsdp: bool = False,
                         fp4_param_field: bool = False) -> list[str]:
        """Megatron-Bridge overrides (``mixed_precision`` wins over ``ddp`` for the grad dtype and FP8 params, so
        both are set). ``fp4_param_field``: the Bridge release's MixedPrecisionConfig has fp4_param_gather, which its
        NVFP4 recipe turns on (``bridge_release.fp4_params``); sweeper runs and estimates NVFP4 with BF16 weights, so
        the file turns it off."""
        out: list[str] = []
        if precision == "nvfp4" and fp4_param_field:
            out.append("mixed_precision.fp4_param_gather=false")
        recipe = self.recipe(precision, compute_capability)
        if recipe is not None:
            out.append(f"mixed_precision.fp8_recipe={recipe}")
            if precision_dtype(precision) == "fp8":  # the recipe name's format may not be this recipe's
                out.append(f"mixed_precision.fp8={fp8_format(recipe)}")
            # Every layer in FP8, as the trial runs and the estimate prices it (Bridge's current-scaling recipe keeps
            # the first and last layer in BF16; Megatron-Core refuses that with delayed scaling).
            out.append("mixed_precision.first_last_layers_bf16=false")
        if recipe == "delayed":  # MixedPrecisionConfig's own defaults are 1 / most_recent
            out += [f"mixed_precision.fp8_amax_history_len={FP8_AMAX_HISTORY_LEN}",
                    f"mixed_precision.fp8_amax_compute_algo={FP8_AMAX_COMPUTE_ALGO}"]
        if precision_dtype(precision) in ("bf16", "fp8", "mxfp8"):
            grads = str(self.grads_in_fp32).lower()
            out += [f"mixed_precision.grad_reduce_in_fp32={grads}", f"ddp.grad_reduce_in_fp32={grads}"]
        if recipe is not None:
            gather = str(self.fp8_params(precision, compute_capability,
                                         distributed_optimizer=distributed_optimizer)).lower()
            out += [f"mixed_precision.fp8_param_gather={gather}", f"ddp.fp8_param_gather={gather}"]
        if recipe == "mxfp8":  # bf16_with_mxfp8_mixed turns it on; DDP's config asserts FP8 parameters with it
            reuse = str(self.reuses_grad_buffer(precision, compute_capability, fsdp=fsdp,
                                                distributed_optimizer=distributed_optimizer)).lower()
            out.append(f"mixed_precision.reuse_grad_buf_for_mxfp8_param_ag={reuse}")
        out.append(f"optimizer.use_precision_aware_optimizer={str(self.precision_aware_optimizer).lower()}")
        if self.precision_aware_optimizer:
            out += [f"optimizer.exp_avg_dtype=torch.{_TORCH_DTYPE[self.exp_avg_dtype]}",
                    f"optimizer.exp_avg_sq_dtype=torch.{_TORCH_DTYPE[self.exp_avg_sq_dtype]}"]
        if self.optimizer_cpu_offload:
            out += ["optimizer.optimizer_cpu_offload=true",
                    f"optimizer.optimizer_offload_fraction={self.offloaded_fraction:g}"]
        out += [f"ddp.overlap_grad_reduce={str(self.overlaps_grad_reduce).lower()}",
                f"ddp.overlap_param_gather={str(self.param_gather_overlap(distributed_optimizer)).lower()}"]
        return out


# Megatron's moment dtype names -> the torch dtype OptimizerConfig takes (FP8 moments are uint8 tensors with scales).
_TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "uint8"}
