"""``megatron_bridge_overrides.yaml``: the winner as an OmegaConf override file for a Megatron-Bridge recipe.

Megatron-Bridge merges such a file onto a recipe's ConfigContainer
(``megatron.bridge.training.utils.omegaconf_utils.process_config_with_overrides(cfg, config_filepath=...)``).
The keys are best_layout.yaml's ``megatron_bridge_overrides`` (``Layout.bridge_overrides`` and
``RunSettings.bridge_overrides``) nested by section, plus the sequence length the sweep measured.

``mixed_precision``: recipes hold it as a recipe name (``"bf16_mixed"``), and Bridge copies its fields over
``ddp`` and ``optimizer`` when it sets up (``MixedPrecisionConfig.setup``), so a name alone would drop the run
settings (e.g. gradients reduced in BF16). When a run setting changes a field, the file gives the whole
MixedPrecisionConfig instead, as a ``_target_`` node Bridge instantiates (``_apply_overrides``): the named
recipe's fields as the Bridge release the file is for defines them (``megatron/bridge/training/mixed_precision.py``),
with the run settings applied.

The release is ``sweeper.config.bridge_release.target()``: the installed Bridge, else the one paired with the
installed megatron-core. Bridge 0.3.1 to 0.6.x take the same keys, recipe paths and recipe names for everything
sweeper writes, except the two facts bridge_release names (NVFP4 weights from 0.4, local layer graphs from 0.6).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import yaml
from omegaconf import OmegaConf
from packaging.version import Version

from sweeper.config import bridge_release, fusions, megatron_release
from sweeper.config.schema import SweepConfig
from sweeper.export.production import measured_note
from sweeper.space.layout import Layout

OVERRIDES_FILE = "megatron_bridge_overrides.yaml"
MIXED_PRECISION_CLASS = "megatron.bridge.training.mixed_precision.MixedPrecisionConfig"

# The pretraining recipe of each preset that Megatron-Bridge ships one for (megatron/bridge/recipes/): the same path
# in 0.3.1 to 0.6.2; from 0.6 each is an alias of the recipe's 8-GPU (Llama 3 8B 2-GPU, 405B 256-GPU, Qwen3 16-GPU)
# H100 BF16 variant (recipes/<family>/h100/).
RECIPES: dict[str, str] = {
    "nemotron-3-nano-30b-a3b": "megatron.bridge.recipes.nemotronh.nemotron_3_nano_pretrain_config",
    "deepseek-v2-lite": "megatron.bridge.recipes.deepseek.deepseek_v2_lite_pretrain_config",
    "llama3-8b": "megatron.bridge.recipes.llama.llama3_8b_pretrain_config",
    "llama3.1-405b": "megatron.bridge.recipes.llama.llama31_405b_pretrain_config",
    "qwen3-30b-a3b": "megatron.bridge.recipes.qwen.qwen3_30b_a3b_pretrain_config",
}


def _dtype(name: str) -> dict[str, Any]:
    return {"_target_": f"torch.{name}", "_call_": False}  # the torch.dtype object itself, not a call


_BF16 = {"bf16": True, "params_dtype": _dtype("bfloat16"), "pipeline_dtype": _dtype("bfloat16"),
         "autocast_enabled": False, "grad_reduce_in_fp32": True}
# The fields each recipe sets (Megatron-Bridge 0.3.1, mixed_precision.py); every other field keeps its default.
# mixed_precision_recipes() adds what later releases change.
MIXED_PRECISION_RECIPES: dict[str, dict[str, Any]] = {
    "bf16_mixed": _BF16,
    "fp16_mixed": {"fp16": True, "params_dtype": _dtype("float16"), "pipeline_dtype": _dtype("float16"),
                   "autocast_enabled": False, "grad_reduce_in_fp32": False},
    "bf16_with_fp8_delayed_scaling_mixed": {
        **_BF16, "fp8": "hybrid", "fp8_recipe": "delayed", "fp8_margin": 0, "fp8_amax_history_len": 1024,
        "fp8_amax_compute_algo": "max", "fp8_param_gather": True},
    # Current scaling's recipe keeps the first and last decoder layer in BF16; sweeper measures every layer in FP8,
    # so the run settings turn that off (RunSettings.bridge_overrides) and the file then gives the whole config.
    "bf16_with_fp8_current_scaling_mixed": {
        **_BF16, "fp8": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1, "fp8_param_gather": True},
    "bf16_with_fp8_subchannel_scaling_mixed": {**_BF16, "fp8": "hybrid", "fp8_recipe": "blockwise",
                                               "fp8_param_gather": False},
    "bf16_with_mxfp8_mixed": {**_BF16, "fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param_gather": True,
                              "reuse_grad_buf_for_mxfp8_param_ag": True},
    "bf16_with_nvfp4_mixed": {**_BF16, "fp8": None, "fp4": "e2m1", "fp4_recipe": "nvfp4", "fp8_param_gather": False,
                              "fp8_recipe": None},
}


def mixed_precision_recipes(release: Version) -> dict[str, dict[str, Any]]:
    """MIXED_PRECISION_RECIPES as Bridge ``release`` defines them."""
    if not bridge_release.fp4_params(release):
        return MIXED_PRECISION_RECIPES
    nvfp4 = {**MIXED_PRECISION_RECIPES["bf16_with_nvfp4_mixed"], "fp4_param_gather": True}
    return {**MIXED_PRECISION_RECIPES, "bf16_with_nvfp4_mixed": nvfp4}


def dotted_overrides(cfg: SweepConfig, layout: Layout) -> list[str]:
    """The winner's Megatron-Bridge overrides in dotted form (best_layout.yaml ``megatron_bridge_overrides``) for
    the Bridge release of ``bridge_release.target()``: the layout's, the run settings' and the framework's kernel
    fusions (``sweeper.config.fusions``). A bare fp8 is written as the recipe the run settings give it on the
    cluster (``fp8:<recipe>``'s Bridge recipe name), not as delayed scaling's recipe overridden field by field."""
    recipe = cfg.run.recipe(layout.precision, cfg.cluster.compute_capability)
    if layout.precision == "fp8" and recipe:
        layout = replace(layout, precision=f"fp8:{recipe}")
    return layout.bridge_overrides(megatron_release.graph_modules()) + cfg.run.bridge_overrides(
        layout.precision, cfg.cluster.compute_capability, distributed_optimizer=layout.distributed_optimizer,
        fsdp=bool(layout.fsdp), fp4_param_field=bridge_release.fp4_params(bridge_release.target()),
    ) + fusions.bridge_overrides(fusions.framework_fusions(cfg.run.framework, cfg.model))


def overrides(cfg: SweepConfig, layout: Layout) -> dict[str, Any]:
    """The override tree (plain containers) for ``layout`` of ``cfg``."""
    dotted = dotted_overrides(cfg, layout)
    precision = [item for item in dotted if item.partition("=")[0].split(".")[0] == "mixed_precision"]
    rest = [item for item in dotted if item not in precision]
    seq = cfg.training.seq_length
    nested = OmegaConf.to_container(OmegaConf.from_dotlist(rest + [f"model.seq_length={seq}",
                                                                   f"dataset.seq_length={seq}"]))
    assert isinstance(nested, dict)
    tree: dict[str, Any] = {str(key): value for key, value in nested.items()}
    tree["mixed_precision"] = _mixed_precision(precision)
    return tree


def _mixed_precision(items: list[str]) -> Any:
    """A recipe name, or the recipe's MixedPrecisionConfig with the run settings' fields (module docstring).

    ``items`` are ``mixed_precision=NAME`` and ``mixed_precision.FIELD=VALUE`` (a dotlist cannot hold both: the
    name is a string, the fields would make it a mapping)."""
    assigned = dict(item.split("=", 1) for item in items)
    name = yaml.safe_load(assigned.pop("mixed_precision"))
    fields = {key.removeprefix("mixed_precision."): yaml.safe_load(value) for key, value in assigned.items()}
    if name is None:
        return None
    recipe = mixed_precision_recipes(bridge_release.target())[name]
    if all(recipe.get(k) == v for k, v in fields.items()):
        return name
    return {"_target_": MIXED_PRECISION_CLASS, **recipe, **fields}


def overrides_yaml(cfg: SweepConfig, layout: Layout, trial: int, measured: Layout | None = None) -> str:
    """The file: a header naming the recipe (when the model has one) and how to apply it, then the tree.
    ``measured``: the trial's layout ``layout`` is the production shape of (named in the header)."""
    recipe = RECIPES.get(cfg.model.name)
    release = bridge_release.target()
    header = [
        f"# {cfg.name}: the layout sweeper found best (trial #{trial}, {layout.short()}) for {cfg.model.name}.",
        f"# Megatron-Bridge recipe: {recipe}" if recipe else
        "# No Megatron-Bridge recipe ships for this model: merge onto the ConfigContainer you build for it.",
        f"# Written for Megatron-Bridge {bridge_release.describe()}.",
        *_refused_note(layout, release),
        "# Apply: process_config_with_overrides(cfg, config_filepath='megatron_bridge_overrides.yaml')",
        "#   (megatron.bridge.training.utils.omegaconf_utils), then pretrain(cfg, forward_step).",
        *measured_note(layout, measured or layout),
    ]
    body = yaml.safe_dump(overrides(cfg, layout), sort_keys=False, width=120)
    return "\n".join(header) + "\n" + body


def _refused_note(layout: Layout, release: Version) -> list[str]:
    """A header line where the Bridge release refuses what the layout measured (bridge_release)."""
    if layout.cuda_graph == "local" and bridge_release.refuses_local_layer_graphs(release):
        return [f"# Megatron-Bridge {release} refuses cuda_graph_impl=local graphs of single layers (from "
                f"{bridge_release.LOCAL_LAYER_GRAPHS_REFUSED_FROM}), which",
                "#   this layout measured: set model.cuda_graph_impl to transformer_engine (not what was measured) or "
                "none before running it."]
    return []
