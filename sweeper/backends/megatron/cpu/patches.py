"""Every megatron-core symbol the CPU stand-ins replace, wrap, subclass or substitute in a spec, with the signature
it was written against and the megatron-core versions it was written for: the table to read when a release moves.

``tests/backends/test_cpu_patches.py`` checks each row against the installed megatron-core (the symbol is still
there, its signature is the one below, the version is in range) and that every patch the stand-ins apply is a
row here. ``signature`` is ``inspect.signature`` of megatron-core's original without its annotations (names,
order, kinds and defaults are what a patch depends on; annotation text changes with Python and torch), for a class
its constructor's. None where the original is not a callable of megatron-core's own: a flag, a MagicMock that
megatron-core puts in place of a class of a missing package, a name it leaves undefined without that package
(``undefined_in`` names those releases), or a module. Patches of torch itself (``torch.cuda`` stand-ins,
``all_gather`` of uneven tensors, the device mode) are not megatron-core's and are not listed.

``versions`` is where a patch applies. A patch that mends a megatron-core defect fixed in a later release (Transformer
Engine's MagicMocks, ``te_general_gemm`` left undefined) names the releases that have the defect; elsewhere the
stand-in finds the fix and leaves megatron-core as it is, and the test checks that it did. Every row was checked
against each release in ``CHECKED``, the ends of the supported range ``SUPPORTED``; where a signature differs
between them, ``signature`` maps each release range to its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet

# The megatron-core releases the CPU stand-ins run on (pyproject's range), and those every row was checked against.
SUPPORTED = ">=0.16.1,<0.20"
CHECKED = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")


@dataclass(frozen=True)
class Patch:
    """One megatron-core symbol a stand-in replaces (``target``, dotted), by whom (``by``, relative to this
    package), the signature it was written against (one, or one per release range: a PEP 440 specifier -> the
    signature) and the megatron-core releases where the patch applies (a PEP 440 specifier)."""

    target: str
    by: str
    signature: str | None | dict[str, str]
    versions: str = SUPPORTED
    undefined_in: str | None = None  # where megatron-core leaves the name undefined without its optional package

    def applies(self, release: str) -> bool:
        """Whether the stand-ins patch this symbol on megatron-core ``release``."""
        return release in SpecifierSet(self.versions)

    def defined_on(self, release: str) -> bool:
        """Whether megatron-core ``release`` defines the name (as None, at least) without the optional package."""
        return self.undefined_in is None or release not in SpecifierSet(self.undefined_in)

    def signature_on(self, release: str) -> str | None:
        """The signature megatron-core ``release`` has (None: not a callable of megatron-core's own)."""
        if not isinstance(self.signature, dict):
            return self.signature
        for versions, signature in self.signature.items():
            if release in SpecifierSet(versions):
                return signature
        raise LookupError(f"{self.target}: no signature recorded for megatron-core {release}")


_MCORE = "megatron.core."
_FSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp."
_IDENTITY = "<class 'megatron.core.transformer.identity_op.IdentityOp'>"

PATCHES: tuple[Patch, ...] = (
    # compat.py: megatron-core's own bugs without Transformer Engine (any device); fixed in 0.19.2: te_general_gemm
    # defined as None, multi-latent attention's HAVE_TE false and its TE classes None, the FSDP adapter's TELinear gone
    Patch(_MCORE + "transformer.moe.moe_utils.te_general_gemm", "compat._patch_megatron_without_te", None,
          "==0.16.1", undefined_in="==0.16.1"),
    Patch(_MCORE + "transformer.multi_latent_attention.HAVE_TE", "compat._patch_megatron_without_te", None,
          "==0.16.1"),
    # The duplicated down projections' class where MLASelfAttention looks for TE's (a MagicMock, later None)
    Patch(_MCORE + "transformer.multi_latent_attention.TELinear", "linear.DuplicatedLinear", None),
    Patch(_MCORE + "distributed.fsdp.mcore_fsdp_adapter.TELinear", "compat._patch_megatron_without_te", None,
          "<0.18"),
    # compat.py: the CPU's
    Patch(_MCORE + "tensor_parallel.random._get_cuda_rng_state", "compat._patch_megatron",
          "(device='cuda', clone=False, graph_safe=False)"),
    Patch(_MCORE + "tensor_parallel.random._set_cuda_rng_state", "compat._patch_megatron",
          "(new_state, device=-1, graph_safe=False)"),
    Patch(_MCORE + "tensor_parallel.random.CudaRNGStatesTracker", "compat._make_cpu_tracker",
          "(use_cudagraphable_rng=False, is_inference_rng_tracker=False)"),
    Patch(_MCORE + "tensor_parallel.random.CudaRNGStatesTracker.add", "compat._make_cpu_tracker",
          "(self, name, seed)"),
    Patch(_MCORE + "tensor_parallel.random.CudaRNGStatesTracker.fork", "compat._make_cpu_tracker",
          "(self, name='model-parallel-rng')"),
    Patch(_MCORE + "transformer.moe.moe_utils.maybe_move_tensor_to_cpu", "compat._patch_alltoall_dispatcher",
          "(tensor, as_numpy=False, record_stream=False)"),
    Patch(_MCORE + "transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu", "compat._patch_alltoall_dispatcher",
          "(tensor, as_numpy=False, record_stream=False)"),
    Patch(_MCORE + "optimizer.clip_grads.l2_norm_impl", "compat._foreach_l2_norm",
          "(chunk_size, noop_flag, tensor_lists, per_tensor, *args)"),
    Patch(_MCORE + "optimizer.clip_grads.multi_tensor_scale_impl", "compat._foreach_scale",
          "(chunk_size, noop_flag, tensor_lists, scale)"),
    Patch(_MCORE + "optimizer.optimizer.multi_tensor_scale_impl", "compat._foreach_scale",
          "(chunk_size, noop_flag, tensor_lists, scale)"),
    Patch(_FSDP + "megatron_fsdp.MegatronFSDP.__init__", "compat._patch_megatron_fsdp", {
        "<0.17": "(self, module, dist_index, ddp_config=None, fsdp_unit_modules=None, disable_bucketing=False, "
                 "device=None, calculate_per_token_loss=False, init_model_with_meta_device=False, "
                 "sync_model_each_microbatch=False, keep_fp8_transpose_cache=False, nccl_ub=False, "
                 "fsdp_double_buffer=False, disable_symmetric_registration=False, "
                 "enable_fine_grained_param_gather_hook=False)",
        "==0.17.*": "(self, module, dist_index, ddp_config=None, mixed_precision_policy=MixedPrecisionPolicy("
                    "main_params_dtype=torch.float32, main_grads_dtype=None, grad_comm_dtype=None), "
                    "fsdp_unit_modules=None, disable_bucketing=False, device=None, calculate_per_token_loss=False, "
                    "init_model_with_meta_device=False, sync_model_each_microbatch=False, "
                    "keep_fp8_transpose_cache=False, nccl_ub=False, fsdp_double_buffer=False, "
                    "fsdp_db_use_persist_buf_on_alloc_fail=False, disable_symmetric_registration=False, "
                    "enable_fine_grained_param_gather_hook=False, report_nan_in_param_grad=False)",
        "==0.18.*": "(self, module, dist_index, ddp_config=None, mixed_precision_policy=MixedPrecisionPolicy("
                    "main_params_dtype=torch.float32, main_grads_dtype=None, grad_comm_dtype=None), "
                    "fsdp_unit_modules=None, disable_bucketing=False, device=None, calculate_per_token_loss=False, "
                    "init_model_with_meta_device=False, sync_model_each_microbatch=False, "
                    "keep_fp8_transpose_cache=False, nccl_ub=False, fsdp_double_buffer=False, "
                    "fsdp_db_use_persist_buf_on_alloc_fail=False, disable_symmetric_registration=False, "
                    "enable_fine_grained_param_gather_hook=False, "
                    "enable_fine_grained_param_gather_backward_hook=False, report_nan_in_param_grad=False)",
        ">=0.19": "(self, module, dist_index, ddp_config=None, mixed_precision_policy=MixedPrecisionPolicy("
                  "main_params_dtype=torch.float32, main_grads_dtype=None, grad_comm_dtype=None), "
                  "fsdp_unit_modules=None, disable_bucketing=False, device=None, calculate_per_token_loss=False, "
                  "init_model_with_meta_device=False, sync_model_each_microbatch=False, "
                  "keep_fp8_transpose_cache=False, nccl_ub=False, fsdp_double_buffer=False, "
                  "fsdp_db_use_persist_buf_on_alloc_fail=False, disable_symmetric_registration=False, "
                  "enable_fine_grained_param_gather_hook=False, enable_fine_grained_param_gather_backward_hook=False, "
                  "fine_grained_recurse_module_types=None, report_nan_in_param_grad=False)"}),
    Patch(_FSDP + "param_and_grad_buffer._coalescing_manager", "compat._patch_megatron_fsdp_collectives",
          "(group=None, device=None, async_ops=False)"),
    Patch(_FSDP + "param_and_grad_buffer.AllGatherPipeline.async_bucket_gather",
          "compat._patch_megatron_fsdp_collectives", "(self, bucket_id, bwd)"),
    Patch(_MCORE + "tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward",
          "compat.products_in_fp32_on_backward", "(ctx, grad_output)"),
    Patch(_MCORE + "tensor_parallel.layers.LinearWithFrozenWeight.backward", "compat.products_in_fp32_on_backward",
          "(ctx, grad_output)"),
    # spec.py's substitutions in the local layer spec, and the modules substituted
    Patch(_MCORE + "transformer.moe.experts.SequentialMLP", "spec.adapt_local_block_spec", {
        "<0.18": "(num_local_experts, config, submodules, pg_collection=None)",
        ">=0.18": "(num_local_experts, config, submodules, pg_collection=None, name=None)"}),
    Patch(_MCORE + "transformer.moe.experts.SequentialMLP.forward", "experts.GroupedSequentialMLP",
          "(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)"),
    Patch(_MCORE + "transformer.dot_product_attention.DotProductAttention", "spec.adapt_local_block_spec",
          "(config, layer_number, attn_mask_type, attention_type, attention_dropout=None, softmax_scale=None, "
          "cp_comm_type=None, pg_collection=None)"),
    Patch(_MCORE + "transformer.dot_product_attention.DotProductAttention.__init__",
          "attention.LatentDotProductAttention",
          "(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None, softmax_scale=None, "
          "cp_comm_type=None, pg_collection=None)"),
    Patch(_MCORE + "transformer.dot_product_attention.DotProductAttention.forward",
          "attention.ContextParallelDotProductAttention",
          "(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, "
          "packed_seq_params=None)"),
    Patch(_MCORE + "transformer.torch_norm.WrappedTorchNorm", "spec.adapt_local_block_spec",
          "(config, hidden_size, eps=1e-05, persist_layer_norm=False, zero_centered_gamma=False, "
          "normalization='LayerNorm')"),
    Patch(_MCORE + "transformer.multi_latent_attention.MLASelfAttentionSubmodules", "spec._swap", {
        "<0.17": "(linear_q_proj=None, linear_q_down_proj=None, linear_q_up_proj=None, linear_kv_down_proj=None, "
                 "linear_kv_up_proj=None, core_attention=None, linear_proj=None, q_layernorm=None, "
                 "kv_layernorm=None)",
        "==0.17.*": "(q_layernorm, kv_layernorm, linear_q_proj=None, linear_q_down_proj=None, "
                    "linear_q_up_proj=None, linear_kv_down_proj=None, linear_kv_up_proj=None, "
                    "linear_qkv_down_proj=None, core_attention=None, linear_proj=None)",
        ">=0.18": "(linear_proj, q_layernorm, kv_layernorm, linear_q_proj=None, linear_q_down_proj=None, "
                  "linear_q_up_proj=None, linear_kv_down_proj=None, linear_kv_up_proj=None, "
                  "linear_qkv_down_proj=None, core_attention=None)"}),
    Patch(_MCORE + "transformer.module.MegatronModule.__init__",
          "attention.ContextParallelDotProductAttention, linear.DuplicatedLinear", "(self, config)"),
    Patch(_MCORE + "transformer.module.MegatronModule.sharded_state_dict", "linear.DuplicatedLinear",
          "(self, prefix='', sharded_offsets=(), metadata=None)"),
    # mamba.py: torch Mamba2 kernels where mamba_ssm (and Triton) are missing, and the local stack spec
    Patch(_MCORE + "ssm.mamba_mixer.mamba_chunk_scan_combined", "mamba.install", None, undefined_in="==0.16.1"),
    Patch(_MCORE + "ssm.mamba_mixer.mamba_split_conv1d_scan_combined", "mamba.install", None,
          undefined_in="==0.16.1"),
    Patch(_MCORE + "ssm.mamba_mixer.RMSNormGated", "mamba.GatedRMSNorm", None),
    Patch(_MCORE + "ssm.mamba_mixer.ExtendedRMSNorm", "mamba.ExtendedGatedRMSNorm", None),
    Patch(_MCORE + "ssm.mamba_mixer.HAVE_MAMBA_SSM", "mamba.install", None),
    # The stack's final norm, where the stack is defined: MambaStack up to 0.16, HybridStack from 0.19 (mamba_block
    # then only re-exports hybrid_block's names)
    Patch(_MCORE + "ssm.mamba_block.TENorm", "mamba.MambaTorchNorm", {
        "==0.16.1": "(config, hidden_size, eps=1e-05)",
        "==0.17.*": "(config, hidden_size, eps=1e-05, has_residual=False)"}, "<0.18"),
    Patch(_MCORE + "models.hybrid.hybrid_block.TENorm", "mamba.MambaTorchNorm",
          "(config, hidden_size, eps=1e-05, has_residual=False)", ">=0.18"),
    # Never from 0.19: megatron.core itself then imports triton (transformer/moe/ops/paged_stash.py)
    Patch(_MCORE + "inference.contexts.attention_context.triton.tensor_ops",
          "mamba._provide_tensor_ops_without_triton", None, "==0.16.1"),
    Patch(_MCORE + "models.mamba.mamba_layer_specs.mamba_stack_spec", "mamba.local_mamba_stack_spec", None),
    # From 0.19 an alias of HybridStackSubmodules, with the GDN, DSA, MLA and MTP entries the local spec leaves out
    Patch(_MCORE + "ssm.mamba_block.MambaStackSubmodules", "mamba.local_mamba_stack_spec", {
        "<0.17": "(" + ", ".join(f"{name}={_IDENTITY}" for name in ("mamba_layer", "attention_layer", "mlp_layer",
                                                                      "moe_layer")) + ")",
        "==0.17.*": "(" + ", ".join(f"{name}={_IDENTITY}" for name in ("mamba_layer", "gdn_layer",
                                                                        "attention_layer", "mlp_layer",
                                                                        "moe_layer")) + ", mtp_block_spec=None)",
        "==0.18.*": "(" + ", ".join(f"{name}={_IDENTITY}" for name in ("mamba_layer", "gdn_layer",
                                                                        "attention_layer", "dsa_layer", "mlp_layer",
                                                                        "moe_layer")) + ", mtp_block_spec=None)",
        ">=0.19": "(" + ", ".join(f"{name}={_IDENTITY}" for name in ("mamba_layer", "gdn_layer", "attention_layer",
                                                                      "dsa_layer", "mla_layer", "mlp_layer",
                                                                      "moe_layer")) + ", mtp_block_spec=None)"}),
    Patch(_MCORE + "ssm.mamba_layer.MambaLayerSubmodules", "mamba.local_mamba_stack_spec",
          "(norm=<class 'megatron.core.transformer.identity_op.IdentityOp'>, "
          "mixer=<class 'megatron.core.transformer.identity_op.IdentityOp'>, "
          "mamba_bda=<class 'megatron.core.transformer.identity_op.IdentityOp'>, "
          "sharded_state_dict_keys_map=<factory>)"),
    Patch(_MCORE + "ssm.mamba_mixer.MambaMixerSubmodules", "mamba.local_mamba_stack_spec",
          "(in_proj=None, out_proj=None)"),
)

# What this process patched: target -> the value put there (read by the test that every patch is a row above).
applied: dict[str, Any] = {}


def dotted(owner: Any) -> str:
    """The dotted name of a module or class."""
    return f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__


def replace(owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)`` on a megatron-core module or class, recorded in ``applied``."""
    applied[f"{dotted(owner)}.{name}"] = value
    setattr(owner, name, value)


def record(target: str, value: Any) -> None:
    """Record a substitution that is not a ``setattr`` (a class swapped in a layer spec, a module stand-in)."""
    applied[target] = value
