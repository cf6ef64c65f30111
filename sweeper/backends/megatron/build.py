"""Build the Megatron pieces of a smoke run from sweeper's values: TransformerConfig, GPTModel chunks, DDP, optimizer.

ModelSpec field names follow TransformerConfig, so most fields pass straight through; the layout supplies the
parallel sizes, precision, recompute and the uneven pipeline split. On the CPU backend the model uses Megatron's
local (pure torch) layer spec (for hybrid Mamba models a local stack spec with torch Mamba2 kernels, cpu/mamba.py),
CPU initialisation and the layout's MoE token dispatcher (alltoall unless it says otherwise); on a GPU with
Transformer Engine it uses the TE layer spec. With virtual pipeline stages one model chunk is built per stage.
Each chunk is wrapped in Megatron's DDP, or with ``Layout.fsdp`` in Megatron-FSDP (FullyShardedDataParallel with
the layout's sharding strategy), under Megatron's (distributed) Adam optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_mtp_block_spec,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import MLATransformerConfig

from sweeper.backends.megatron.architecture import mamba_config_kwargs, mamba_model_builder, mla_config_kwargs
from sweeper.backends.megatron.cpu.spec import adapt_local_block_spec
from sweeper.backends.megatron.device import device_capability_text, rank_device
from sweeper.backends.megatron.failures import InvalidLayoutError
from sweeper.backends.megatron.layout_config import layout_config_kwargs, params_dtype
from sweeper.config.run_settings import MOE_AUX_LOSS_COEFF, MOE_LOAD_BALANCING_TYPE, RunSettings, fp8_format
from sweeper.models.params import padded_vocab_size
from sweeper.models.spec import ModelSpec
from sweeper.space.layout import Layout

# Megatron-FSDP's bucket (elements), as measured on gloo (docs/MEGATRON_ON_CPU.md).
_FSDP_BUCKET_ELEMENTS = 10**7


def use_transformer_engine(cuda: bool, te_available: bool) -> bool:
    """The TE layer spec on a GPU with TE; Megatron's local torch spec otherwise (always on the CPU)."""
    return cuda and te_available


def transformer_config(spec: ModelSpec, layout: Layout, *, cuda: bool, te: bool,
                       run: RunSettings = RunSettings()) -> TransformerConfig:
    """Megatron's TransformerConfig; its __post_init__ asserts the layout rules (heads % TP, ...)."""
    moe: dict[str, Any] = {}
    if spec.is_moe:
        moe = dict(
            num_moe_experts=spec.num_moe_experts,
            moe_router_topk=spec.moe_router_topk,
            moe_ffn_hidden_size=spec.expert_ffn_hidden_size,
            moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
            # DeepSeek's first-k-dense layers: 0 = dense MLP, 1 = MoE, one entry per layer.
            moe_layer_freq=[0] * spec.moe_first_k_dense + [1] * (spec.num_layers - spec.moe_first_k_dense),
            moe_router_pre_softmax=spec.moe_router_pre_softmax,
            moe_router_num_groups=spec.moe_router_num_groups,
            moe_router_load_balancing_type=MOE_LOAD_BALANCING_TYPE,
            moe_aux_loss_coeff=MOE_AUX_LOSS_COEFF,
            moe_grouped_gemm=te,
        )
    fp8: dict[str, Any] = {}
    recipe = run.recipe(layout.precision, None)  # None: no device here; the CPU backend refuses FP8 (support.py)
    if recipe is not None:
        fp8 = dict(fp8=fp8_format(recipe), fp8_recipe=recipe)
    config_class: type[TransformerConfig] = TransformerConfig
    arch: dict[str, Any] = {}
    if spec.multi_latent_attention and not te:  # the GPU plan carries the same fields (gpu.gpu_plan)
        config_class, arch = MLATransformerConfig, mla_config_kwargs(spec)
    if spec.is_hybrid and not te:
        arch = mamba_config_kwargs(spec)
    # Kernel fusions (sweeper.config.fusions): on the GPU path the run's framework's, less those whose kernel is
    # missing here. The CPU backend keeps megatron-core's defaults, all off: its local spec runs torch's norms
    # (torch_norm.py asserts persist_layer_norm off) and no apex or TE (gradient accumulation and RoPE fusion raise
    # without their kernels); the CPU proves the layout's arithmetic, not the GPU's kernels (MEGATRON_ON_CPU.md).
    if te:  # GPU path (gpu.py): this device's FP8 recipe, MLA / Mamba fields, CP through TE; not run on a GPU yet
        from sweeper.backends.megatron import gpu

        plan = gpu.device_plan(spec, layout, run)
        fp8, config_class = dict(plan.config_kwargs), gpu.config_class(plan)
        fp8.update(plan.fusions)
        fp8.update(gpu.run_config_kwargs(layout, run, device_capability_text()))
    return config_class(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.query_groups,
        kv_channels=spec.head_dim,
        gated_linear_unit=spec.gated_linear_unit,
        activation_func=F.silu if spec.gated_linear_unit else F.gelu,
        normalization=spec.normalization,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        # Multi-token prediction: megatron-core's MTP block (multi_token_prediction.py) after the last decoder layer.
        mtp_num_layers=spec.mtp_num_layers or None,
        **layout_config_kwargs(spec, layout, cuda=cuda),
        **moe,
        **fp8,
        **arch,
    )


def mtp_block_spec(spec: ModelSpec, config: TransformerConfig, te: bool, vp_stage: int | None) -> Any:
    """Megatron's MTP block spec for this virtual stage (None where it holds no MTP layer, or the model has none):
    the model's last decoder layer (Megatron-LM's choice: DeepSeek-V3's MTP layer is a MoE layer like its last)
    with the MTP norms and eh_proj, through the same CPU adaptation as the decoder block."""
    if not spec.mtp_num_layers:
        return None
    last_layer = get_gpt_decoder_layer_specs(config, use_transformer_engine=te, normalization=spec.normalization)[-1]
    block = get_gpt_mtp_block_spec(config, last_layer, use_transformer_engine=te, vp_stage=vp_stage)
    return block if te or block is None else adapt_local_block_spec(block, config)


@dataclass
class Built:
    config: TransformerConfig
    # One chunk per virtual pipeline stage (one without VPP): DistributedDataParallel, or FullyShardedDataParallel
    # when ``fsdp`` is set.
    model: list[Any]
    optimizer: MegatronOptimizer
    vocab_size: int  # padded
    fsdp: str | None = None  # Layout.fsdp: the chunks are Megatron-FSDP's

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of this rank's chunks, named ``chunk<i>.<name inside the chunk>``.

        With Megatron-FSDP these are this rank's shards of the distributed (optimizer) parameters, DTensors over
        the data-parallel ranks (fsdp_parameters); the module's own parameters may be views into a released
        all-gather buffer (optim_grads_params) and are never read directly."""
        if self.fsdp:
            return {f"chunk{i}.{name}": param for i, name, param in self.fsdp_parameters()}
        return {
            f"chunk{i}.{name}": param
            for i, ddp in enumerate(self.model)
            for name, param in ddp.module.named_parameters()
        }

    @property
    def overlap_param_gather(self) -> bool:
        return bool(self.model[0].ddp_config.overlap_param_gather)

    def sync_params(self) -> None:
        """Finish the parameter all-gather the optimizer step left to the next forward (``overlap_param_gather``
        defers it to the forward pre-hooks, Megatron's distrib_optimizer.py): afterwards every rank's model
        weights are the step's, as the replica check and the saves must read them (Megatron-LM forces the same
        sync before it saves). A no-op without the overlap (the step gathered synchronously)."""
        if self.overlap_param_gather:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    def refill_param_buffer(self) -> None:
        """Call after the chunks' zero_grad_buffer: with MXFP8 weights gathered through the grad buffer
        (reuse_grad_buf_for_mxfp8_param_ag) and the gather overlapped with the forward, the buffer the forward
        pre-hooks gather from is the grad buffer just zeroed, and the optimizer step left the main parameters'
        copy into it to the training loop (optimizer.py). Megatron-LM's train_step (training.py, core_v0.16.1) and
        Bridge's train.py copy them here, only while the pre-hooks are on (otherwise the weights are in place and
        the copy would land in the main grads); so does this. A no-op in every other run."""
        ddp = self.model[0].ddp_config
        if not (ddp.reuse_grad_buf_for_mxfp8_param_ag and ddp.overlap_param_gather):
            return
        if not self.model[0].remove_forward_pre_hook_handles:
            return
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if isinstance(inner, DistributedOptimizer):
                inner._copy_main_params_to_param_buffer()  # noqa: SLF001 - what Megatron-LM calls here

    def fsdp_parameters(self) -> list[tuple[int, str, torch.Tensor]]:
        """Megatron-FSDP: (chunk index, name, distributed parameter) in the same order on every rank."""
        return [(i, name, param) for i, chunk in enumerate(self.model)
                for name, param in chunk.param_and_grad_buffer.optimizer_named_parameters]

    def bare_chunks(self) -> list[torch.nn.Module]:
        """The model chunks inside the data-parallel wrappers (GPTModel, Float16Module or MambaModel)."""
        return [chunk.module.module if self.fsdp else chunk.module for chunk in self.model]


def build(
    spec: ModelSpec, layout: Layout, *, cuda: bool, te: bool, seed: int, vocab_size: int | None = None,
    run: RunSettings = RunSettings(), before_wrap: Callable[[list[torch.nn.Module]], None] | None = None,
) -> Built:
    """Config, model chunks wrapped in Megatron DDP (or Megatron-FSDP), and Megatron's (distributed) Adam optimizer.

    ``vocab_size``: the padded vocabulary to build with instead of Megatron's default (a multiple of 128 x TP);
    the equivalence gate passes the reference's, which must match the checkpoint's shapes. ``before_wrap`` is
    called with the bare chunks before they are wrapped: the gate loads the reference into them there for
    Megatron-FSDP, whose wrapped model does not load a torch_dist checkpoint."""
    from megatron.core import tensor_parallel

    config = transformer_config(spec, layout, cuda=cuda, te=te, run=run)
    model_class: Any = GPTModel
    if te:  # GPU path (gpu.py): MambaModel, or Megatron-Bridge's own model for model: {hf: DIR}
        from sweeper.backends.megatron import gpu

        config, model_class = gpu.gpu_model(spec, layout, config, run)
    elif spec.is_hybrid:  # torch Mamba2 kernels and a local hybrid stack spec (cpu/mamba.py)
        from sweeper.backends.megatron.cpu import mamba

        mamba.install()
        model_class = mamba_model_builder(spec, adapt_local_block_spec(mamba.local_mamba_stack_spec(), config))
    # Same seed on every rank: CPU initialisation draws full weights from the global generator, then shards them.
    torch.manual_seed(seed)
    # A CUDA graph replays its RNG calls: Megatron's CudaGraphManager asserts a graph-safe tracker (TE's, as
    # Megatron-LM picks it for graphs: use_te_rng_tracker, use_cudagraphable_rng).
    tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=config.use_te_rng_tracker,
                                                    use_cudagraphable_rng=layout.cuda_graph != "none")
    vocab = vocab_size or padded_vocab_size(spec, layout.tp)
    vpp = layout.vpp if layout.vpp > 1 else None
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(layout.vpp) if vpp else [None]:
        block_spec = None if spec.is_hybrid else get_gpt_decoder_block_spec(  # MambaModel brings its own stack
            config, use_transformer_engine=te, normalization=spec.normalization, vp_stage=vp_stage
        )
        if not te and block_spec is not None:
            # CP attention and SP norms of our own where Megatron's local modules refuse them (cpu/spec.py).
            block_spec = adapt_local_block_spec(block_spec, config)
        mtp = {"mtp_block_spec": mtp_block_spec(spec, config, te, vp_stage)} if model_class is GPTModel else {}
        chunk = model_class(
            config=config,
            transformer_layer_spec=block_spec,
            **mtp,
            vocab_size=vocab,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not spec.untie_embeddings_and_output_weights,
            position_embedding_type=spec.position_embedding_type,
            vp_stage=vp_stage,
        )
        if cuda:
            chunk.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            # As Megatron-LM does: the whole chunk (norms included) in half precision, fp32 loss on the last stage.
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    if before_wrap is not None:
        before_wrap(chunks)

    model = (_fsdp_chunks if layout.fsdp else _ddp_chunks)(config, layout, chunks, cuda=cuda, te=te,
                                                                 run=run)
    config.finalize_model_grads_func = finalize_model_grads
    _install_sync_funcs(config, model, layout, run)

    # Megatron's own gloo groups (create_gloo_process_groups=False at init): NCCL runs need a reachable gloo
    # interface across nodes for them and use them only for optimizer-state checkpoints, which smoke runs skip.
    optimizer = get_megatron_optimizer(optimizer_config(layout, run, te=te), model, use_gloo_process_groups=False)
    foreach_adam(optimizer)
    dtype = params_dtype(layout)
    if dtype is torch.float16:
        config.grad_scale_func = optimizer.scale_loss
    return Built(config=config, model=model, optimizer=optimizer, vocab_size=vocab, fsdp=layout.fsdp)


def foreach_adam(optimizer: Any) -> None:
    """torch's Adam in its foreach form where megatron-core falls back to torch's optimizer (no TE or Apex: the
    CPU): torch picks the for-loop form off CUDA, a Python loop over thousands of expert tensors in a MoE proxy.
    The same update; torch reads the group's flag at each step."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
            for group in torch_optimizer.param_groups:
                if group.get("foreach") is None:
                    group["foreach"] = True


def optimizer_config(layout: Layout, run: RunSettings, *, te: bool = False) -> OptimizerConfig:
    """Megatron's Adam as the export's training flags set it (--clip-grad, --adam-beta1/2), the layout's
    precision and optimizer sharding, and the run settings' moments and offload.

    Megatron-LM fills OptimizerConfig from its arguments by field name (training.py get_megatron_optimizer_config),
    so it also carries the FP8 recipe (the distributed optimizer shards MXFP8 / blockwise FP8 weights differently
    from delayed scaling's, distrib_optimizer.py), the param-gather overlap and the MXFP8 grad-buffer reuse (with
    both, the optimizer leaves copying its main parameters into the buffer to the training loop:
    Built.refill_param_buffer)."""
    dtype = params_dtype(layout)
    return OptimizerConfig(
        optimizer="adam",
        lr=1e-4,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=1.0,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        params_dtype=dtype,
        initial_loss_scale=2.0**16,
        use_distributed_optimizer=layout.distributed_optimizer,
        fp8_recipe=run.recipe(layout.precision, device_capability_text()) if te else None,
        overlap_param_gather=run.param_gather_overlap(layout.distributed_optimizer),
        reuse_grad_buf_for_mxfp8_param_ag=mxfp8_grad_buffer_reuse(layout, run, te),
        **run.optimizer_kwargs(),
    )


def fp8_params(layout: Layout, run: RunSettings, te: bool) -> bool:
    """FP8 weights in the parameter buffer and its all-gather (--fp8-param-gather): the run settings' choice for
    this device, on the GPU path only (the CPU backend runs no FP8)."""
    return te and run.fp8_params(layout.precision, device_capability_text(),
                                 distributed_optimizer=layout.distributed_optimizer)


def mxfp8_grad_buffer_reuse(layout: Layout, run: RunSettings, te: bool) -> bool:
    """MXFP8 weights all-gathered through the grad buffer (reuse_grad_buf_for_mxfp8_param_ag, DDP's and the
    optimizer's): RunSettings.reuses_grad_buffer for this device, on the GPU path only."""
    return te and run.reuses_grad_buffer(layout.precision, device_capability_text(), fsdp=bool(layout.fsdp),
                                         distributed_optimizer=layout.distributed_optimizer)


def ddp_config(layout: Layout, run: RunSettings, *, cuda: bool, te: bool) -> DistributedDataParallelConfig:
    """Megatron's DDP config, for DDP or (``Layout.fsdp``) Megatron-FSDP: the run settings' grad dtype, as the
    estimator counts it (RunSettings.grad_buffer_fp32), their overlaps (run on gloo too, through its async
    collectives: the CPU proves their wiring, _install_sync_funcs) and FP8 parameters."""
    common: dict[str, Any] = dict(
        grad_reduce_in_fp32=run.grad_buffer_fp32(layout.precision),
        **_overlap_config(layout, run),
        use_distributed_optimizer=layout.distributed_optimizer,
        fp8_param_gather=fp8_params(layout, run, te),
        reuse_grad_buf_for_mxfp8_param_ag=mxfp8_grad_buffer_reuse(layout, run, te),
    )
    if not layout.fsdp:
        return DistributedDataParallelConfig(**common)
    return DistributedDataParallelConfig(
        **common,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=layout.fsdp,
        # Megatron's default fuses the 1/DP averaging into the reduce-scatter as a PREMUL_SUM, which gloo lacks;
        # unfused it pre-multiplies and SUMs (the same result, measured bit-identical to DDP on gloo).
        gradient_reduce_div_fusion=cuda,
        bucket_size=_FSDP_BUCKET_ELEMENTS,
    )


def _install_sync_funcs(config: TransformerConfig, model: list[Any], layout: Layout, run: RunSettings) -> None:
    """The schedule's hooks into the data-parallel wrappers, as Megatron-LM's training.py installs them (its
    align_grad_reduce default, align_param_gather with the interleaved schedule only).

    With ``overlap_grad_reduce`` the backward hooks start a bucket's reduce-scatter once its gradients are ready:
    without ``no_sync_func`` every micro-batch counts as the last one, and megatron-core 0.16.1 (which learns the
    count on the first batch, the equivalence gate's) starts the reduction once as many micro-batches as that batch
    had are done: a step with more trains on a half-reduced gradient, no error (measured:
    tests/backends/test_equivalence.py, overlapped vs synchronous losses)."""
    if run.overlaps_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        grad_sync = [chunk.start_grad_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        config.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    if model[0].ddp_config.align_param_gather:
        param_sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = param_sync[0] if len(model) == 1 else param_sync


def _ddp_chunks(config: TransformerConfig, layout: Layout, chunks: list[torch.nn.Module], *, cuda: bool, te: bool,
                run: RunSettings) -> list[Any]:
    ddp = ddp_config(layout, run, cuda=cuda, te=te)
    model = [
        # Megatron-LM buckets only the first chunk's gradients; later chunks reduce as one bucket each.
        DistributedDataParallel(config=config, ddp_config=ddp, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    for chunk in model:
        chunk.broadcast_params()  # identical replicas across data-parallel ranks, whatever the initialisation
    return model


def _overlap_config(layout: Layout, run: RunSettings) -> dict[str, bool]:
    """DistributedDataParallelConfig's overlap fields: the param-gather overlap needs the distributed optimizer
    (Megatron-LM asserts it; the export leaves the flag out without it), and aligns its all-gathers with the
    pipeline only under the interleaved schedule (Megatron-LM's validate_args turns align_param_gather off
    otherwise)."""
    param_gather = run.param_gather_overlap(layout.distributed_optimizer)
    return dict(overlap_grad_reduce=run.overlaps_grad_reduce, overlap_param_gather=param_gather,
                align_param_gather=param_gather and layout.vpp > 1)


def _fsdp_chunks(config: TransformerConfig, layout: Layout, chunks: list[torch.nn.Module], *, cuda: bool, te: bool,
                 run: RunSettings) -> list[Any]:
    """Megatron-FSDP with the layout's sharding strategy (optim | optim_grads | optim_grads_params) and the
    distributed optimizer (the megatron_fsdp rule requires it), on the device this rank runs on."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    if not layout.distributed_optimizer:  # the megatron_fsdp rule refuses it before launch; a direct request too
        raise InvalidLayoutError("Megatron-FSDP v1 is only compatible with --use-distributed-optimizer")
    fsdp_config = ddp_config(layout, run, cuda=cuda, te=te)
    device = rank_device()
    # No broadcast_params: it broadcasts the module's parameters, which under optim_grads_params are views into a
    # released all-gather buffer. Every rank initialised the same weights from the same seed (or loaded the same
    # reference before wrapping), and each rank's shard is cut from them.
    return [
        FullyShardedDataParallel(config=config, ddp_config=fsdp_config, module=chunk, device=device,
                                 disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
