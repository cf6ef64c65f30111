"""The GPU branch of the megatron backend, tested without CUDA: the (spec, layout, capability) → config mapping,
real TransformerConfig / MLATransformerConfig construction with those kwargs, the support matrix GPU vs CPU, the
Megatron-Bridge import errors and the GPU check script's syntax. What only a GPU can show (TE kernels, FP8 GEMMs,
MambaModel with mamba_ssm, Bridge's provider) is run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import subprocess
from pathlib import Path
from unittest import mock

import pytest

from sweeper.backends.megatron import gpu
from sweeper.backends.megatron.failures import UnsupportedError, classify
from sweeper.backends.megatron.support import unsupported_reason
from sweeper.config import megatron_release
from sweeper.config.kernels import Kernels
from sweeper.config.run_settings import RunSettings
from sweeper.errors import ModelError
from sweeper.models.catalog import preset, resolve_model
from sweeper.space.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
HOPPER, ADA, AMPERE, B200, RTX_PRO_6000 = (9, 0), (8, 9), (8, 0), (10, 0), (12, 0)


def lo(**kw) -> Layout:
    kw.setdefault("world_size", kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1))
    return Layout(**kw)


# -- layer spec choice -------------------------------------------------------------------------------------------------
def test_dense_gpt_uses_the_transformer_engine_spec():
    plan = gpu.gpu_plan(preset("llama3-8b"), lo(tp=2, sp=True), HOPPER)
    assert plan.model_class == "GPTModel" and plan.config_class == "TransformerConfig"
    assert "get_gpt_layer_with_transformer_engine_spec" in plan.layer_spec
    assert plan.layer_spec_kwargs == dict(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                                          multi_latent_attention=False)
    assert plan.fp8_recipe is None and plan.notes == ()


def test_moe_uses_grouped_gemm_and_qk_norm_in_the_te_spec():
    plan = gpu.gpu_plan(preset("qwen3-30b-a3b"), lo(ep=1), HOPPER)
    assert plan.layer_spec_kwargs == dict(num_experts=128, moe_grouped_gemm=True, qk_layernorm=True,
                                          multi_latent_attention=False)


def test_context_parallel_goes_through_te_with_p2p():
    assert gpu.gpu_plan(preset("tiny-gpt"), lo(cp=2), HOPPER).config_kwargs == {"cp_comm_type": "p2p"}
    assert "cp_comm_type" not in gpu.gpu_plan(preset("tiny-gpt"), lo(), HOPPER).config_kwargs


# -- precision recipes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("capability", "recipe", "fmt"), [
    (ADA, "delayed", "hybrid"), (HOPPER, "delayed", "hybrid"), ((9, 2), "delayed", "hybrid"),
    (B200, "tensorwise", "hybrid"), (RTX_PRO_6000, "tensorwise", "hybrid"),
])
def test_default_fp8_recipe_per_capability(capability, recipe, fmt):
    plan = gpu.gpu_plan(preset("tiny-gpt"), lo(precision="fp8"), capability)
    assert plan.fp8_recipe == recipe
    assert plan.config_kwargs["fp8_recipe"] == recipe and plan.config_kwargs["fp8"] == fmt
    assert plan.notes == (f"precision fp8: recipe {recipe} (default for compute capability "
                          f"{capability[0]}.{capability[1]}), format {fmt}",)


def test_delayed_scaling_keeps_an_amax_history():
    kwargs = gpu.gpu_plan(preset("tiny-gpt"), lo(precision="fp8"), HOPPER).config_kwargs
    assert kwargs == dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_amax_compute_algo="max")


def test_blockwise_on_request_from_hopper_up():
    plan = gpu.gpu_plan(preset("tiny-gpt"), lo(precision="fp8"), HOPPER, fp8_recipe="blockwise")
    assert plan.config_kwargs == dict(fp8="e4m3", fp8_recipe="blockwise")
    assert plan.notes == ("precision fp8: recipe blockwise (requested), format e4m3",)
    with pytest.raises(gpu.GpuPrecisionError, match=r"blockwise scaling needs compute capability >= 9.0; this GPU is 8.9"):
        gpu.gpu_plan(preset("tiny-gpt"), lo(precision="fp8"), ADA, fp8_recipe="blockwise")
    with pytest.raises(gpu.GpuPrecisionError, match="unknown FP8 recipe 'fancy'"):
        gpu.gpu_plan(preset("tiny-gpt"), lo(precision="fp8"), HOPPER, fp8_recipe="fancy")


def test_the_requested_recipe_is_the_run_setting(monkeypatch):
    """run.fp8_recipe (the YAML) reaches the GPU plan; auto leaves the pick to the device."""
    seen = []
    monkeypatch.setattr(gpu, "gpu_plan", lambda spec, layout, capability, **kw: seen.append(kw["fp8_recipe"]))

    from sweeper.backends.megatron import device

    monkeypatch.setattr(device, "compute_capability", lambda: HOPPER)
    gpu.device_plan(preset("tiny-gpt"), lo(precision="fp8"), RunSettings(fp8_recipe="blockwise"))
    gpu.device_plan(preset("tiny-gpt"), lo(precision="fp8"), RunSettings())
    assert seen == ["blockwise", None]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_a_precision_that_names_its_recipe_runs_it_whatever_the_run_says(recipe):
    """fp8:<recipe> (issue 52) is that recipe on every device that runs it, run.fp8_recipe notwithstanding."""
    for capability in (HOPPER, B200):
        plan = gpu.gpu_plan(preset("tiny-gpt"), lo(precision=f"fp8:{recipe}"), capability,
                            fp8_recipe="delayed" if recipe != "delayed" else "tensorwise")
        assert plan.fp8_recipe == recipe and plan.config_kwargs["fp8_recipe"] == recipe
    with pytest.raises(gpu.GpuPrecisionError, match="FP8 needs compute capability >= 8.9"):
        gpu.gpu_plan(preset("tiny-gpt"), lo(precision=f"fp8:{recipe}"), AMPERE)


def test_fp8_refused_below_8_9():
    with pytest.raises(gpu.GpuPrecisionError, match=r"FP8 needs compute capability >= 8.9 .*this GPU is 8.0"):
        gpu.gpu_plan(preset("tiny-gpt"), lo(precision="fp8"), AMPERE)


def test_mxfp8_only_on_10_x():
    plan = gpu.gpu_plan(preset("tiny-gpt"), lo(precision="mxfp8"), B200)
    assert plan.config_kwargs == dict(fp8="e4m3", fp8_recipe="mxfp8") and plan.fp8_recipe == "mxfp8"
    for capability, text in ((HOPPER, "9.0"), (RTX_PRO_6000, "12.0"), (ADA, "8.9")):
        with pytest.raises(gpu.GpuPrecisionError, match=rf"MXFP8 needs compute capability 10.x .* on {text}"):
            gpu.gpu_plan(preset("tiny-gpt"), lo(precision="mxfp8"), capability)
    # run.fp8_recipe is only a bare fp8's recipe: MXFP8 keeps its own (one sweep compares them, issue 52).
    assert gpu.gpu_plan(preset("tiny-gpt"), lo(precision="mxfp8"), B200, fp8_recipe="delayed").fp8_recipe == "mxfp8"


def test_nvfp4_only_on_10_x():
    plan = gpu.gpu_plan(preset("tiny-gpt"), lo(precision="nvfp4"), B200)
    assert plan.config_kwargs == dict(fp4="e2m1", fp4_recipe="nvfp4") and plan.fp8_recipe == "nvfp4"
    for capability, text in ((HOPPER, "9.0"), (RTX_PRO_6000, "12.0")):
        with pytest.raises(gpu.GpuPrecisionError, match=rf"NVFP4 needs compute capability 10.x .* is {text}"):
            gpu.gpu_plan(preset("tiny-gpt"), lo(precision="nvfp4"), capability)
    assert gpu.gpu_plan(preset("tiny-gpt"), lo(precision="nvfp4"), B200, fp8_recipe="tensorwise").fp8_recipe == "nvfp4"


def test_a_precision_the_device_cannot_run_is_reported_unsupported():
    with pytest.raises(gpu.GpuPrecisionError) as info:
        gpu.gpu_plan(preset("tiny-gpt"), lo(precision="mxfp8"), HOPPER)
    assert isinstance(info.value, UnsupportedError)
    assert classify(info.value, "build")[0] == "unsupported"


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_no_fp8_fields_without_fp8(precision):
    assert gpu.gpu_plan(preset("tiny-gpt"), lo(precision=precision), AMPERE).config_kwargs == {}


# -- MLA and hybrid Mamba ------------------------------------------------------------------------------------------
def test_mla_fields_from_the_deepseek_v2_lite_preset():
    plan = gpu.gpu_plan(preset("deepseek-v2-lite"), lo(), HOPPER)
    assert plan.model_class == "GPTModel" and plan.config_class == "MLATransformerConfig"
    assert plan.layer_spec_kwargs["multi_latent_attention"] is True
    assert plan.layer_spec_kwargs["num_experts"] == 64
    k = plan.config_kwargs
    assert k["multi_latent_attention"] is True
    assert k["q_lora_rank"] is None  # V2-Lite compresses no queries
    assert (k["kv_lora_rank"], k["qk_head_dim"], k["qk_pos_emb_head_dim"], k["v_head_dim"]) == (512, 128, 64, 128)
    assert (k["rope_type"], k["rotary_base"], k["rotary_scaling_factor"], k["original_max_position_embeddings"]) == \
        ("yarn", 10000, 40.0, 4096)


def test_mamba_fields_and_pattern_from_the_nemotron_preset():
    spec = preset("nemotron-3-nano-30b-a3b")
    plan = gpu.gpu_plan(spec, lo(), HOPPER)
    assert plan.model_class == "MambaModel" and plan.config_class == "TransformerConfig"
    assert plan.layer_spec.endswith("mamba_layer_specs.mamba_stack_spec")
    assert plan.layer_spec_kwargs == {"hybrid_override_pattern": spec.hybrid_layer_pattern, "d_conv": 4}
    assert plan.layer_spec_kwargs["hybrid_override_pattern"].count("M") == 23
    assert plan.config_kwargs == dict(is_hybrid_model=True, mamba_num_heads=64, mamba_head_dim=64,
                                      mamba_num_groups=8, mamba_state_dim=128)
    assert plan.notes == ()


def test_missing_causal_conv1d_is_a_note_and_the_slow_path():
    plan = gpu.gpu_plan(preset("nemotron-3-nano-30b-a3b"), lo(), HOPPER, causal_conv1d=False)
    assert plan.config_kwargs["use_mamba_mem_eff_path"] is False
    assert plan.notes == ("Mamba fast path missing (no causal-conv1d): slow path",)


# -- the kwargs are real TransformerConfig fields and build.py accepts them ----------------------------------------
def _build_keywords() -> set[str]:
    """The keyword names build.transformer_config passes to the config class itself (read from its source)."""
    tree = ast.parse((ROOT / "sweeper/backends/megatron/build.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "transformer_config")
    call = next(n for n in ast.walk(fn) if isinstance(n, ast.Return)).value
    assert isinstance(call, ast.Call)
    return {k.arg for k in call.keywords if k.arg}


CASES = [
    ("tiny-gpt", dict(precision="fp8"), B200), ("tiny-gpt", dict(precision="fp8"), HOPPER),
    ("tiny-gpt", dict(precision="mxfp8"), B200), ("tiny-gpt", dict(cp=2), HOPPER),
    ("deepseek-v2-lite", dict(cp=2), HOPPER), ("nemotron-3-nano-30b-a3b", dict(precision="fp8"), HOPPER),
]


@pytest.mark.parametrize(("name", "layout", "capability"), CASES)
def test_plan_kwargs_are_config_fields_and_never_collide_with_build(name, layout, capability):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    plan = gpu.gpu_plan(preset(name), lo(**layout), capability, causal_conv1d=False)
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    assert set(plan.config_kwargs) <= fields
    assert not set(plan.config_kwargs) & _build_keywords()


@pytest.mark.parametrize(("name", "layout"), [
    ("tiny-gpt", lo(precision="fp8")), ("tiny-gpt", lo(cp=2)), ("tiny-moe", lo()),
    ("deepseek-v2-lite", lo()), ("nemotron-3-nano-30b-a3b", lo()),
])
def test_build_constructs_the_gpu_config_for_real(name, layout):
    """build.transformer_config on the TE path, with the device's plan stubbed (no CUDA here): Megatron's own
    __post_init__ validates the GPU kwargs. (FP8 with MoE needs TE installed for its version check.)"""
    from sweeper.backends.megatron import build

    spec = preset(name)
    with mock.patch.object(gpu, "device_plan", lambda s, lo, run: gpu.gpu_plan(s, lo, HOPPER, causal_conv1d=False)):
        config = build.transformer_config(spec, layout, cuda=True, te=True)
    assert config.use_cpu_initialization is False
    if spec.multi_latent_attention:
        assert type(config).__name__ == "MLATransformerConfig"
        assert config.q_lora_rank is None and config.kv_lora_rank == 512 and config.rope_type == "yarn"
    if spec.is_hybrid:
        assert config.is_hybrid_model and config.mamba_num_heads == 64 and config.use_mamba_mem_eff_path is False
    if layout.precision == "fp8":
        assert (config.fp8, config.fp8_recipe, config.fp8_amax_history_len) == ("hybrid", "delayed", 1024)
    if layout.cp > 1:
        assert config.cp_comm_type == "p2p"
    if spec.is_moe:
        assert config.moe_grouped_gemm and config.moe_token_dispatcher_type == "alltoall"


# -- support matrix: GPU+TE vs CPU ----------------------------------------------------------------------------------
def test_support_matrix_gpu_vs_cpu():
    mla, hybrid = preset("deepseek-v2-lite"), preset("nemotron-3-nano-30b-a3b")
    assert unsupported_reason(mla, lo(), cuda=True, te=True) is None
    # The GPU nodes' kernels, as the driver learnt them from the nodes (this machine, the driver, has none).
    on_nodes = Kernels(transformer_engine=True, mamba_ssm=True)
    assert unsupported_reason(hybrid, lo(), cuda=True, te=True, kernels=on_nodes) is None
    # The CPU backend runs both architectures (torch Mamba2 kernels, local MLA spec), at CPU size only (the
    # production models need --proxy there); a GPU without TE runs neither.
    for model in (mla, hybrid):
        assert "CPU trials are for models up to 1B parameters" in unsupported_reason(model, lo(), cuda=False, te=False)
    assert unsupported_reason(mla, lo(), cuda=True, te=False) == (
        "multi_latent_attention (MLA) unsupported on this backend (megatron-core-gpu): MLA's layer spec needs "
        "Transformer Engine on a GPU")
    assert "mamba_stack_spec needs Transformer Engine" in unsupported_reason(hybrid, lo(), cuda=True, te=False)
    assert unsupported_reason(preset("tiny-gpt"), lo(precision="fp8"), cuda=True, te=True) is None
    # NVFP4 without TE would train in BF16: never a CPU pass; every FP8 recipe as a precision value (issue 52) too.
    for precision in ("fp8", "fp8:delayed", "fp8:tensorwise", "fp8:blockwise", "mxfp8", "nvfp4"):
        reason = unsupported_reason(preset("tiny-gpt"), lo(precision=precision), cuda=False, te=False)
        assert reason is not None and f"precision {precision} unsupported on this backend" in reason
        assert "FP8 and FP4 GEMMs need Transformer Engine" in reason


def test_gpu_refuses_hybrid_without_mamba_ssm_and_fp8_mla_with_cp():
    reason = unsupported_reason(preset("nemotron-3-nano-30b-a3b"), lo(), cuda=True, te=True,
                                kernels=Kernels(transformer_engine=True))
    assert reason == ("hybrid Mamba model (hybrid_layer_pattern) unsupported on this backend (megatron-core-gpu): "
                      "Megatron's MambaMixer needs the mamba_ssm package (pip install mamba-ssm causal-conv1d)")
    reason = unsupported_reason(preset("deepseek-v2-lite"), lo(cp=2, precision="fp8"), cuda=True, te=True)
    assert reason == ("FP8 multi_latent_attention with context parallel (cp=2) unsupported on this backend "
                      "(megatron-core-gpu): Transformer Engine's MLA context-parallel attention has no FP8 path")
    assert unsupported_reason(preset("deepseek-v2-lite"), lo(cp=2), cuda=True, te=True) is None


# -- Megatron-Bridge -------------------------------------------------------------------------------------------------
def _hf_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256)))
    return folder


def _bridge_installed(installed: bool):
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "megatron.bridge":
            return object() if installed else None
        return real(name, *args)

    return mock.patch("importlib.util.find_spec", find_spec)


def test_hf_key_without_bridge_is_a_clear_error(tmp_path):
    with _bridge_installed(False), pytest.raises(ModelError) as info:
        resolve_model({"hf": str(_hf_dir(tmp_path))})
    assert str(info.value) == (
        "hf needs Megatron-Bridge, which is not installed (pip install -e '.[bridge]' installs the release paired "
        "with the installed megatron-core, with Transformer Engine: docs/support-matrix.md); for planning alone use "
        "{hf_config: DIR}")
    assert info.value.where == ".hf"


def test_hf_key_with_bridge_reads_the_local_config(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    folder = _hf_dir(tmp_path)
    with _bridge_installed(True):
        spec = resolve_model({"hf": "tiny-llama"}, base_dir=tmp_path)
    assert spec.name == f"hf:{folder}" and spec.num_layers == 2 and spec.num_query_groups == 2
    assert gpu.bridge_source(spec) == folder
    assert gpu.bridge_source(preset("tiny-gpt")) is None
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_hf_key_takes_a_hub_cache_folder(tmp_path):
    cache = tmp_path / "models--org--tiny"
    snapshot = cache / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((_hf_dir(tmp_path) / "config.json").read_text())
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("abc123\n")
    with _bridge_installed(True):
        assert resolve_model({"hf": str(cache)}).name == f"hf:{snapshot}"


def test_hf_key_never_downloads_and_takes_no_other_keys(tmp_path):
    with _bridge_installed(True):
        with pytest.raises(ModelError, match="not a local folder .*sweeper never downloads"):
            resolve_model({"hf": "meta-llama/Meta-Llama-3-8B"}, base_dir=tmp_path)
        with pytest.raises(ModelError) as info:
            resolve_model({"hf": str(tmp_path), "num_layers": 2})
    assert info.value.where == ".num_layers"


def test_bridge_provider_without_bridge_installed_is_a_clear_error(tmp_path):
    with _bridge_installed(True):
        spec = resolve_model({"hf": str(_hf_dir(tmp_path))})
    with mock.patch.dict("sys.modules", {"megatron.bridge": None}), pytest.raises(gpu.BridgeMissingError) as info:
        gpu.bridge_provider(spec, lo(), gpu.gpu_plan(spec, lo(), HOPPER), RunSettings())
    assert str(info.value).startswith(f"model: {{hf: {tmp_path / 'tiny-llama'}}} needs Megatron-Bridge, which is "
                                      "not installed (pip install -e '.[bridge]'")


def test_bridge_overrides_are_transformer_config_fields():
    from megatron.core.transformer import TransformerConfig

    layout = lo(tp=2, pp=2, cp=2, sp=True, precision="fp8", recompute="full", first_stage_layers=3,
                last_stage_layers=1)
    overrides = gpu.bridge_overrides(preset("tiny-gpt"), layout, gpu.gpu_plan(preset("tiny-gpt"), layout, B200),
                                     RunSettings(), "10.0")
    assert set(overrides) <= {f.name for f in dataclasses.fields(TransformerConfig)}
    assert overrides["tensor_model_parallel_size"] == 2 and overrides["sequence_parallel"] is True
    assert overrides["virtual_pipeline_model_parallel_size"] is None
    assert (overrides["fp8"], overrides["fp8_recipe"], overrides["cp_comm_type"]) == ("hybrid", "tensorwise", "p2p")
    assert overrides["bf16"] is True and overrides["fp16"] is False
    assert overrides["recompute_granularity"] == "full"
    assert (overrides["num_layers_in_first_pipeline_stage"], overrides["num_layers_in_last_pipeline_stage"]) == (3, 1)


# -- the GPU check script --------------------------------------------------------------------------------------------
def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu_check.sh")], check=True)


ISSUE_44_CASES = {"bf16-moe-graph-local", "bf16-moe-a2a-ep2", "fp8-dense-bf16-ref", "fp8-bridge-params",
                  "mxfp8-fp8-params", "bf16-cc-mismatch", "bf16-dense-warm", "bf16-dense-warm-closefds"}


def _plan_only(tmp_path: Path, **env: str) -> tuple[dict[str, str], Path]:
    """gpu_check.sh --plan-only for a pretend B200 with two GPUs: its table's rows by case, and its kept folder."""
    import sys

    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "GPU_CHECK_DEVICE": "10.0 180 2 yes yes no B200",
           "TMPDIR": str(tmp_path), "SWEEPER_GPU_CHECK_KEEP": "1", **env}
    out = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--plan-only"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith(("bf16", "fp8", "mxfp8"))}
    (work,) = tmp_path.glob("sweeper-gpu-check.*")
    return rows, work


def test_gpu_check_plan_only_writes_valid_spaces(tmp_path):
    """--plan-only: every case's space loads (plan exits 0) and its layout is valid for a pretend B200 with two
    GPUs, but the one a rule refuses; issue 44's cases write the space each is there to show."""
    from sweeper.config.load import load_config

    rows, work = _plan_only(tmp_path)
    assert set(rows) == {"bf16-dense", "fp8-dense", "fp8-blockwise", "mxfp8-dense", "bf16-moe", "bf16-mla",
                         "bf16-dense-tp2-sp", "bf16-hybrid", "bf16-graph-mbs1", "bf16-graph-mbs2", "bf16-overlap-dp2",
                         "bf16-bridge-llama", "bf16-dense-1b-mbs1", "bf16-dense-1b-mbs2"} | ISSUE_44_CASES
    assert "skipped" in rows["fp8-blockwise"]  # Hopper only
    assert "skipped" in rows["bf16-bridge-llama"]  # --plan-only assumes no Megatron-Bridge
    # rules.local_graphs_dropless_moe (issue 44 item 4): the case shows the refusal
    refused = rows["bf16-moe-graph-local"]
    assert " planned " in refused and "captures the MoE layers whole" in refused, refused
    for name in set(rows) - {"fp8-blockwise", "bf16-bridge-llama", "bf16-moe-graph-local"}:
        assert " planned " in rows[name] and "invalid" not in rows[name], rows[name]
    assert (work / "fp8-dense-bf16-ref.plan.json").is_file()

    space = {name: load_config(work / f"{name}.yaml") for name in ISSUE_44_CASES}
    # The FP8 trial is gated against bf16-dense's reference: the same space name, BF16 first.
    assert space["fp8-dense-bf16-ref"].name == "gpu-check-bf16-dense"
    assert space["fp8-dense-bf16-ref"].space.values("precision") == ["bf16", "fp8"]
    bridge = space["fp8-bridge-params"]
    assert bridge.run.framework == "megatron-bridge" and bridge.training.checkpoint
    assert bridge.run.fp8_params("fp8", bridge.cluster.compute_capability, distributed_optimizer=True)
    mxfp8 = space["mxfp8-fp8-params"]
    assert mxfp8.run.reuses_grad_buffer("mxfp8", mxfp8.cluster.compute_capability, fsdp=False,
                                        distributed_optimizer=True)
    assert space["bf16-moe-a2a-ep2"].space.values("ep") == [2]
    assert space["bf16-cc-mismatch"].cluster.compute_capability == "9.0"  # the pretend card is 10.0
    assert space["bf16-dense-warm"].cluster.warm_ranks and space["bf16-dense-warm-closefds"].cluster.warm_ranks
    assert space["bf16-dense-warm"].name == "gpu-check-bf16-dense"
    assert load_config(work / "bf16-dense.yaml").cluster.warm_ranks is None  # fresh rank actors on GPUs


def test_gpu_check_runs_a_group(tmp_path):
    """GPU_CHECK_ONLY=issue44 runs issue 44's cases and the earlier ones it names (bf16-dense, the mbs-2 graph,
    TP2+SP), nothing else."""
    rows, _ = _plan_only(tmp_path, GPU_CHECK_ONLY="issue44")
    ran = {name for name, row in rows.items() if " planned " in row}
    assert ran == ISSUE_44_CASES | {"bf16-dense", "bf16-graph-mbs2", "bf16-dense-tp2-sp"}


def test_gpu_check_installs_from_a_wheelhouse_first(tmp_path):
    """GPU_CHECK_WHEELHOUSE: a venv over this python's packages, scripts/install_offline.sh into it, then the cases
    with its python. STAND-IN: everything is installed here already, so an empty wheelhouse serves (pip finds
    sweeper and its dependencies satisfied through this python's site-packages); a missing one exits 3."""
    (tmp_path / "wheels").mkdir()
    rows, work = _plan_only(tmp_path, GPU_CHECK_WHEELHOUSE=str(tmp_path / "wheels"), GPU_CHECK_ONLY="bf16-dense")
    assert " planned " in rows["bf16-dense"]
    assert "install_offline: sweeper imports offline" in (work / "install.log").read_text()
    assert (work / "venv" / "bin" / "python").exists()
    missing = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--plan-only"], cwd=ROOT,
                             env={"PATH": "/usr/bin:/bin", "GPU_CHECK_WHEELHOUSE": str(tmp_path / "none")},
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 3 and "is not a folder" in missing.stderr


def test_gpu_check_fork_switch_closes_the_device_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16-dense-warm-closefds' switch: SWEEPER_FORK_CLOSE_DEVICE_FILES=1 in a forked rank's environment closes the
    driver's device files the child keeps otherwise. STAND-IN: no /dev/nvidia* here, /dev/null plays it."""
    import os

    from sweeper.record.schema import TrialChecks
    from sweeper.trial import forked

    monkeypatch.setattr(forked, "_DEVICE_FILES", ("/dev/null",))
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        listing = lambda: sorted(int(n) for n in os.listdir("/proc/self/fd"))  # noqa: E731
        kept = forked.ForkedRank(listing, TrialChecks, {}).wait()
        closed = forked.ForkedRank(listing, TrialChecks, {forked.CLOSE_DEVICE_FILES_ENV: "1"}).wait()
    finally:
        os.close(fd)
    assert fd in kept and fd not in closed


def test_the_cpu_backend_names_each_knob_it_cannot_run():
    """Issue 18: flex dispatch, the A2A overlap, CUDA graphs and activation offload are GPU-only; the alltoall and
    allgather dispatchers run on the CPU (cpu.compat). Megatron-FSDP runs on the CPU with data, tensor and expert
    parallelism (tests/backends/test_fsdp.py); with pipeline parallelism it has not been verified."""
    moe = preset("tiny-moe")
    cases = ((dict(ep=2, moe_token_dispatcher="flex:deepep"), "moe_token_dispatcher flex:deepep", "DeepEP"),
             (dict(ep=2, moe_a2a_overlap=True), "moe_a2a_overlap (overlap_moe_expert_parallel_comm)", "CUDA streams"),
             (dict(cuda_graph="te:attn"), "cuda_graph te:attn", "CUDAGraph"),
             (dict(offload_layers=1), "offload_layers 1", "cpu_offload"),
             (dict(pp=2, fsdp="optim"), "fsdp optim (Megatron-FSDP)", "with pp=2 it has not been verified"))
    for kw, feature, why in cases:
        reason = unsupported_reason(moe, lo(world_size=2, **kw), cuda=False, te=False)
        assert reason is not None and reason.startswith(f"{feature} unsupported on this backend (megatron-core-cpu)")
        assert why in reason
    for dispatcher in ("alltoall", "allgather"):
        assert unsupported_reason(moe, lo(world_size=2, ep=2, moe_token_dispatcher=dispatcher), cuda=False,
                                  te=False) is None
    assert unsupported_reason(moe, lo(world_size=2, fsdp="optim_grads_params"), cuda=False, te=False) is None
    flex = lo(world_size=2, ep=2, moe_token_dispatcher="flex:hybridep")
    reason = unsupported_reason(moe, flex, cuda=True, te=True, kernels=Kernels(transformer_engine=True))
    assert reason is not None and "needs DeepEP" in reason
    assert unsupported_reason(moe, flex, cuda=True, te=True, kernels=Kernels(transformer_engine=True, deep_ep=True)) \
        is None


def test_the_shared_loss_is_made_on_the_device_the_losses_are_on() -> None:
    """Megatron leaves the last stage's losses on the rank's GPU; everything the aggregation makes beside them
    must be made there. The meta device stands in for the GPU: a CPU tensor made next to a meta loss fails
    ``torch.stack`` exactly as a CPU tensor next to a CUDA loss does."""
    import torch

    from sweeper.backends.megatron.steps import loss_pair

    meta = torch.device("meta")
    losses = [{"lm loss": torch.empty((), device=meta)} for _ in range(3)]
    with pytest.raises(RuntimeError):  # what the aggregation did before: a CPU count stacked with the loss
        torch.stack([torch.stack([d["lm loss"] for d in losses]).mean(), torch.tensor(1.0)])
    assert loss_pair(losses, True, meta).device == meta
    assert loss_pair([], False, meta).device == meta  # a stage without the loss makes its zeros there too
    cpu = loss_pair([{"lm loss": torch.tensor(2.0)}, {"lm loss": torch.tensor(4.0)}], True, torch.device("cpu"))
    assert cpu.tolist() == [3.0, 1.0]


# -- issue 30: a broken Transformer Engine, the warm-rank fork guard ------------------------------------------------
def test_a_broken_transformer_engine_fails_the_rank_as_infra(monkeypatch):
    """Installed but not importable (a CUDA library missing): the rank fails as infra with the import error
    instead of building Megatron's local spec on the GPU while the driver believes TE is there."""
    import importlib.util
    import sys

    from sweeper.backends.megatron import device
    from sweeper.backends.megatron.failures import classify

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine"
                        else None)

    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name.startswith("transformer_engine"):
                raise OSError("libcudnn.so.9: cannot open shared object file")
            return None

    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    for name in [n for n in sys.modules if n.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(device.TransformerEngineImportError) as err:
        device.transformer_engine_present()
    assert classify(err.value, "setup") == (
        "infra", "Transformer Engine is installed but does not import on this rank: libcudnn.so.9: "
                 "cannot open shared object file")


def test_transformer_engine_not_installed_is_no_te():
    from sweeper.backends.megatron import device

    assert device.transformer_engine_present() is False  # this machine has none: the local spec, no failure


def test_warm_up_refuses_a_cuda_torch_whose_nvml_does_not_answer(monkeypatch):
    """torch's CUDA check falls back to cudaGetDeviceCount when NVML fails, which initialises CUDA in the warm
    parent without torch.cuda.is_initialized() saying so: its forked ranks could not use the GPU."""
    import torch

    from sweeper.backends import megatron

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)
    with pytest.raises(RuntimeError, match="NVML does not answer on this node.*cluster.warm_ranks: false"):
        megatron.warm_up(gpu=True)


def test_a_cpu_warm_rank_with_a_cuda_torch_and_no_nvml_warms_up(monkeypatch):
    """A simulated cluster's warm ranks on a machine without GPUs and a CUDA build of torch (what `pip install
    torch` gives): the NVML guard matters only for GPU ranks; it failed every trial of the quickstart."""
    import torch

    from sweeper.backends import megatron

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)
    megatron.warm_up(gpu=False)
    assert not torch.cuda.is_initialized()


def test_a_gpu_rank_without_transformer_engine_gets_megatrons_no_te_fixes(monkeypatch):
    """Seen on an H200 without TE: megatron-core 0.16.1's router referenced an undefined ``te_general_gemm``
    (NameError at the first MoE forward) because these fixes were made on CPU ranks only. On a CUDA rank install()
    makes them (and none of the CPU redirections)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import torch

    from sweeper.backends.megatron.cpu import compat

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(compat, "_without_te_patched", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    assert compat.install() is False  # the CPU redirections stay off on a CUDA rank
    assert moe_utils.te_general_gemm is None  # the router's torch path
    assert torch.cuda.current_device is current_device


def test_the_gpu_refuses_the_cuda_graphs_it_does_not_capture():
    """Issue 30: full-iteration and Transformer Engine graphs are captured by Megatron-LM's train loop, not by
    megatron-core; the smoke run would measure eager layers while recording them as graphed. Local per-layer
    graphs are captured by megatron-core's schedules and stay."""
    moe = preset("tiny-moe")
    for value in ("full_iteration", "te:attn", "te:attn+moe_router"):
        reason = unsupported_reason(moe, lo(world_size=2, ep=2, cuda_graph=value), cuda=True, te=True)
        assert reason is not None and reason.startswith(f"cuda_graph {value} unsupported on this backend")
        assert "would measure eager layers" in reason
    assert unsupported_reason(moe, lo(world_size=2, ep=2, cuda_graph="local"), cuda=True, te=True) is None


def test_a_rank_on_another_compute_capability_than_declared_fails_as_infra(monkeypatch):
    """Issue 44: every GPU rank reports its device's capability and fails the trial with one line when it is not
    the YAML's (the rank would pick the FP8 recipe for another device than the environment and exports). A
    stand-in: the device is faked (no GPU here); the comparison itself is tests/config/test_capability.py's."""
    import torch

    from sweeper.backends.megatron.device import CapabilityMismatchError, check_declared_capability

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA B200")
    assert check_declared_capability("10.0", rank=0) == "10.0"
    with pytest.raises(CapabilityMismatchError) as info:
        check_declared_capability("9.0", rank=3)
    kind, error = classify(info.value, "setup")
    assert kind == "infra" and error.startswith("cluster.compute_capability is 9.0 but rank 3's GPU (NVIDIA B200) "
                                                "is 10.0")


def test_the_steps_peak_leaves_a_mid_run_checkpoint_out(monkeypatch):
    """On a GPU the allocator's high-water mark is global: the steps' peak is read before a mid-run save and the
    statistics reset after it, so a save that briefly needs more does not become the trial's peak. The CUDA
    allocator's two counters are stood in for by a fake (no GPU here)."""
    import torch

    from sweeper.backends.megatron.memory import PhasePeak, StepsPeak

    state = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=0))
    steps = StepsPeak(cuda=True)
    state["peak"] = 10  # steps 1-2
    steps.pause()
    with PhasePeak(cuda=True) as save:
        state["peak"] = 25  # the save
    steps.resume()
    state["peak"] = 12  # steps 3-4
    assert steps.peak_bytes() == 12 and save.peak_bytes == 25


def test_the_steps_peak_starts_when_the_steps_start_on_a_gpu(monkeypatch):
    """Issue 44: build, the reference load and the gate (with FP8 parameters the load dequantizes every weight at
    once) must not be the steps' peak; they are reported apart as the peak before the steps. A stand-in: the CUDA
    allocator's high-water mark is faked (monotone, reset to what is held), no GPU here; the CPU's own figure is
    tested for real in tests/backends/test_backend_megatron.py."""
    import torch

    from sweeper.backends.megatron.memory import StepsPeak

    allocator = {"held": 0, "peak": 0}

    def hold(nbytes: int) -> None:
        allocator["held"] = nbytes
        allocator["peak"] = max(allocator["peak"], nbytes)

    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: allocator.update(peak=allocator["held"]))
    hold(40)  # the reference load dequantizes every weight at once
    hold(8)  # the model the steps start from
    steps = StepsPeak(cuda=True)
    hold(20)  # a step
    hold(8)
    assert steps.peak_bytes() == 20 and steps.before_bytes == 40


@pytest.mark.parametrize("layout", [
    lo(world_size=2, ep=2, precision="nvfp4"),
    lo(world_size=4, tp=2, sp=True, ep=2, moe_token_dispatcher="allgather", cuda_graph="local"),
    lo(world_size=2, ep=2, offload_layers=1),
    lo(world_size=4, ep=4, precision="bf16", moe_a2a_overlap=True, recompute="selective"),
    lo(world_size=4, pp=2, vpp=2, precision="fp8"),
])
def test_a_bridge_model_gets_every_field_the_layout_decides(layout):
    """Issue 30: Megatron-Bridge's provider is given the same layout fields a preset's GPU trial builds with
    (FP4, the dispatcher, graphs, offload, the A2A overlap, recompute, the split, FP8 weights under Bridge's
    defaults): compared against build.transformer_config on the TE path for the same model (device mocked)."""
    from sweeper.backends.megatron import build, device

    spec, run = preset("tiny-moe"), RunSettings(framework="megatron-bridge")
    plan = gpu.gpu_plan(spec, layout, B200 if layout.precision == "nvfp4" else HOPPER, causal_conv1d=False)
    capability = "10.0" if layout.precision == "nvfp4" else "9.0"
    overrides = gpu.bridge_overrides(spec, layout, plan, run, capability)
    from megatron.core import utils
    from packaging.version import Version

    cc = tuple(map(int, capability.split(".")))
    with mock.patch.object(gpu, "device_plan", lambda s, lo, r: plan), \
            mock.patch.object(device, "compute_capability", lambda: cc), \
            mock.patch.object(utils, "get_te_version", lambda: Version("2.12.0")):  # FP8/FP4 MoE asks TE's version
        config = build.transformer_config(spec, layout, cuda=True, te=True, run=run)
    for name, value in overrides.items():
        assert getattr(config, name) == value, name
    for name in layout.knob_config(megatron_release.graph_modules()):
        assert name in overrides
    if layout.precision == "nvfp4":
        assert (overrides["fp4"], overrides["fp4_recipe"]) == ("e2m1", "nvfp4")
    if layout.precision == "fp8":
        assert overrides["fp8_param"] is True  # Bridge's FP8 recipes gather FP8 weights


def test_blockwise_fp8_needs_cuda_12_9_and_is_unsupported_not_the_layouts_fault():
    """Transformer Engine runs blockwise FP8 GEMMs from CUDA 12.9: on an older CUDA build the GPU plan refuses the
    recipe as unsupported (the device's), before anything is built, instead of TE asserting at the first step
    (which the trial filed invalid_layout and told Optuna)."""
    from sweeper.backends.megatron.failures import classify

    layout, spec = lo(precision="fp8"), preset("tiny-gpt")
    assert gpu.cuda_version("12.8") == (12, 8) and gpu.cuda_version("13.0") == (13, 0) and gpu.cuda_version(None) is None
    with pytest.raises(gpu.GpuPrecisionError, match=r"needs CUDA >= 12.9 .* built for CUDA 12.8") as err:
        gpu.gpu_plan(spec, layout, HOPPER, fp8_recipe="blockwise", cuda=(12, 8))
    assert classify(err.value, "build")[0] == "unsupported"
    plan = gpu.gpu_plan(spec, layout, HOPPER, fp8_recipe="blockwise", cuda=(12, 9))
    assert plan.config_kwargs["fp8_recipe"] == "blockwise" and plan.config_kwargs["fp8"] == "e4m3"
    assert gpu.gpu_plan(spec, layout, HOPPER, cuda=(12, 4)).fp8_recipe == "delayed"  # only blockwise needs 12.9


def test_the_forward_step_gives_megatrons_combined_1f1b_schedule_its_schedule_plan(monkeypatch):
    """Issue 44, item 1: megatron-core's combined 1F1B schedule (moe_a2a_overlap) calls the forward step with
    return_schedule_plan=True on the unwrapped GPTModel and asserts a schedule plan back; sweeper's step had no such
    keyword (TypeError, filed infra, re-run, never measured). The model here is a STAND-IN recording the call (the
    schedule needs CUDA streams; the CPU backend refuses moe_a2a_overlap)."""
    import inspect

    import torch
    from megatron.core.pipeline_parallel import combined_1f1b

    from sweeper.backends.megatron import steps

    assert "return_schedule_plan=True" in inspect.getsource(combined_1f1b)  # the call this step must accept

    class PlanningModel:
        def build_schedule_plan(self, tokens, position_ids, attention_mask, labels=None):
            self.call = (tokens, position_ids, attention_mask, labels)
            return "schedule plan"

    monkeypatch.setattr(steps, "_on_this_cp_rank", lambda batch: batch)  # one CP rank: the whole sequence
    batch = steps.Batch(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long),
                        torch.arange(4).unsqueeze(0))
    model = PlanningModel()
    plan, loss = steps._forward_step(False, 1.0, iter([batch]), model, return_schedule_plan=True)
    assert plan == "schedule plan" and loss.func is steps._loss_func
    assert model.call[2] is None and model.call[3] is batch.labels


def test_local_layer_graphs_of_an_hf_model_are_refused_where_bridge_refuses_them(tmp_path, monkeypatch):
    """Bridge 0.6 refuses cuda_graph_impl=local other than full-iteration graphs (utils/cuda_graph.py); up to 0.5
    its provider builds them. Presets are built by megatron-core alone and keep them."""
    from packaging.version import Version

    from sweeper.config import bridge_release

    with _bridge_installed(True):
        spec = resolve_model({"hf": str(_hf_dir(tmp_path))})
    graphs = lo(cuda_graph="local")
    kernels = Kernels(transformer_engine=True)
    monkeypatch.setattr(bridge_release, "target", lambda: Version("0.6.2"))
    assert gpu.gpu_unsupported_reason(spec, graphs, kernels=kernels) == (
        "cuda_graph local with Megatron-Bridge 0.6.2 (model: {hf: DIR})",
        "Bridge's provide() refuses cuda_graph_impl=local other than full-iteration graphs from 0.6")
    assert gpu.gpu_unsupported_reason(preset("tiny-gpt"), graphs, kernels=kernels) is None
    monkeypatch.setattr(bridge_release, "target", lambda: Version("0.5.1"))
    assert gpu.gpu_unsupported_reason(spec, graphs, kernels=kernels) is None
