"""Context and sequence parallelism on the CPU backend (gloo): the modules are right, and smoke trials pass.

Unit tests run sweeper's CP attention and SP norms in real gloo ranks against Megatron's non-parallel modules:
outputs and gradients must match (fp32). End-to-end tests run the megatron backend's ``run_rank`` in real ranks
(CP2, TP2+SP, MoE TP2+SP+EP2, TP2·CP2) with checkpoint save/reload, and prove the CP module on the whole model:
a CP2 run's losses and gradient norms on the same batches equal the CP1 run's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the rank-spawning helper lives next to this file

from megatron_ranks import _context, free_port, run_ranks

from sweeper.backends.base import RankReport, SmokeRequest
from sweeper.backends.megatron.support import unsupported_reason
from sweeper.models.catalog import preset
from sweeper.models.proxy import proxy
from sweeper.space.layout import Layout

# --------------------------------------------------------------------------------------------------------------
# helpers: run a function in W gloo ranks


def _worker_main(rank: int, world: int, port: int, fn: Any, args: tuple, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        from sweeper.backends.megatron.cpu import compat

        compat.install()
        torch.distributed.init_process_group("gloo")
        out.put((rank, "ok", fn(rank, *args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails with it
        import traceback

        out.put((rank, "error", traceback.format_exc(limit=8) + repr(exc)))
    finally:
        from megatron.core import parallel_state

        if torch.distributed.is_initialized():
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


def _in_ranks(fn: Any, world: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """fn(rank, *args) in ``world`` fresh gloo ranks; the list of their return values (a rank's error fails)."""
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker_main, args=(r, world, port, fn, args, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, status, value = out.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
                continue
            assert status == "ok", f"rank {rank} failed:\n{value}"
            results[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert len(results) == world, f"ranks {sorted(set(range(world)) - set(results))} died or hung"
    return [results[r] for r in range(world)]


# --------------------------------------------------------------------------------------------------------------
# unit: CP attention equals Megatron's DotProductAttention on the full sequence (outputs and gradients)


def _attention_case(rank: int, cp: int, groups: int) -> dict[str, float]:
    """Max abs errors of this CP rank's output and q/k/v gradients against non-CP attention on the whole sequence."""
    import dataclasses

    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from sweeper.backends.megatron.cpu.attention import ContextParallelDotProductAttention, load_balanced_positions
    from sweeper.backends.megatron.releases import batch_on_this_cp_rank

    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(1)  # attention dropout forks the model-parallel RNG
    heads, head_dim, seq, batch = 4, 16, 8 * cp, 2
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, context_parallel_size=cp, use_cpu_initialization=True,
                               attention_dropout=0.0, hidden_dropout=0.0)
    reference = DotProductAttention(dataclasses.replace(config, context_parallel_size=1), 1, AttnMaskType.causal,
                                    "self")
    under_test = ContextParallelDotProductAttention(config, 1, AttnMaskType.causal, "self")

    gen = torch.Generator().manual_seed(7)  # the same full tensors on every rank
    q = torch.randn(seq, batch, heads, head_dim, generator=gen)
    k = torch.randn(seq, batch, groups, head_dim, generator=gen)
    v = torch.randn(seq, batch, groups, head_dim, generator=gen)
    upstream = torch.randn(seq, batch, heads * head_dim, generator=gen)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = reference(*full, None)
    (out_ref * upstream).sum().backward()

    mine = load_balanced_positions(seq // cp, cp, parallel_state.get_context_parallel_rank())
    # The positions this module assumes are the ones Megatron's batch split gives this rank.
    megatron_split = batch_on_this_cp_rank({"tokens": torch.arange(seq).unsqueeze(0)})["tokens"][0]
    assert megatron_split.tolist() == mine.tolist(), (megatron_split, mine)
    local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    out = under_test(*local, None)
    # The sum of the CP ranks' local objectives is the full objective, so each local gradient must equal the
    # full gradient at the rank's positions once K/V gradients are reduce-scattered.
    (out * upstream[mine]).sum().backward()
    errors = {"out": (out - out_ref[mine]).abs().max().item(), "out_scale": out_ref.abs().max().item()}
    for name, a, b in zip("qkv", local, full):
        errors[f"d{name}"] = (a.grad - b.grad[mine]).abs().max().item()
        errors[f"d{name}_scale"] = b.grad.abs().max().item()
    return errors


def _assert_attention_equal(results: list[dict[str, float]]) -> None:
    for errors in results:
        for name in ("out", "dq", "dk", "dv"):
            # fp32, same arithmetic in the same key order: only reduction-order rounding may differ.
            assert errors[name] <= 1e-5 * errors[f"{name}_scale"], (name, errors)


def test_gathered_chunks_return_to_sequence_order() -> None:
    import torch

    from sweeper.backends.megatron.cpu.attention import load_balanced_positions, to_sequence_order

    for cp in (2, 3, 4):
        seq = 4 * cp
        # What an all-gather over the CP ranks holds: each rank's positions, in rank order.
        gathered = torch.cat([load_balanced_positions(seq // cp, cp, rank) for rank in range(cp)])
        assert to_sequence_order(gathered, cp).tolist() == list(range(seq))


def test_cp2_attention_equals_full_attention_mha_and_gqa() -> None:
    per_rank = _in_ranks(_attention_cases, 2, 2)
    assert all(len(results) == 2 for results in per_rank)  # MHA and GQA on each rank
    _assert_attention_equal([errors for results in per_rank for errors in results])


def _attention_cases(rank: int, cp: int) -> list[dict[str, float]]:
    # MHA (4 heads, 4 groups) and GQA (4 heads, 2 groups) in the same ranks: one process start for both.
    from megatron.core import parallel_state

    results = []
    for groups in (4, 2):
        results.append(_attention_case(rank, cp, groups))
        parallel_state.destroy_model_parallel()
    return results


def test_cp4_attention_equals_full_attention_gqa() -> None:
    results = _in_ranks(_attention_case, 4, 4, 2)
    _assert_attention_equal(results)


# --------------------------------------------------------------------------------------------------------------
# unit: the SP path (norms, scatter/gather, SP linears, finalize_model_grads) equals the non-SP path


def _tp2_grads(rank: int) -> dict[str, Any]:
    """Loss and every gradient of tiny-gpt TP2 (fp32) after one forward/backward, with and without SP."""
    from functools import partial

    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from sweeper.backends.megatron import steps
    from sweeper.backends.megatron.build import build

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    out: dict[str, Any] = {}
    for sp in (False, True):
        layout = Layout(world_size=2, tp=2, sp=sp, gbs=1, precision="fp32", distributed_optimizer=False)
        built = build(preset("tiny-gpt"), layout, cuda=False, te=False, seed=1234)
        batches = steps.micro_batches(seed=3, step=1, layout=layout, seq_length=32, vocab_size=256,
                                      device=torch.device("cpu"))
        losses = get_forward_backward_func()(  # runs finalize_model_grads (the SP norm-grad all-reduce) itself
            forward_step_func=partial(steps._forward_step, False, 1.0), data_iterator=iter(batches),
            model=built.model[0], num_microbatches=1, seq_length=32, micro_batch_size=1, forward_only=False,
        )
        norms = {n: p for n, p in built.model[0].named_parameters() if "layernorm" in n}
        out[f"sp={sp}"] = dict(
            loss=losses[0]["lm loss"].item(),
            grads={n: p.main_grad.clone() for n, p in built.model[0].named_parameters()},
            norms_marked=len(norms) > 0 and all(getattr(p, "sequence_parallel", False) for p in norms.values()),
        )
    plain, sp = out["sp=False"], out["sp=True"]
    # Plain numbers back (tensors through a queue outlive their sender badly): relative error per gradient.
    return dict(
        loss=(plain["loss"], sp["loss"]),
        norms_marked=sp["norms_marked"],
        names=(sorted(plain["grads"]), sorted(sp["grads"])),
        grad_rel_err={n: ((sp["grads"][n] - g).norm() / g.norm()).item() for n, g in plain["grads"].items()},
    )


def test_sequence_parallel_equals_plain_tp_loss_and_gradients() -> None:
    for result in _in_ranks(_tp2_grads, 2):
        assert result["norms_marked"]
        plain_loss, sp_loss = result["loss"]
        assert sp_loss == pytest.approx(plain_loss, rel=1e-6)
        assert result["names"][0] == result["names"][1]
        # Norm weights would be off by the TP factor if their gradients were not summed across the TP group.
        worst = max(result["grad_rel_err"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5, worst


# --------------------------------------------------------------------------------------------------------------
# unit: what the CPU backend now accepts


def test_cpu_backend_accepts_sp_and_cp_but_still_refuses_gpu_only_features() -> None:
    assert unsupported_reason(preset("tiny-gpt"), Layout(world_size=4, tp=2, cp=2, sp=True), cuda=False,
                              te=False) is None
    assert unsupported_reason(preset("tiny-moe"), Layout(world_size=2, tp=2, sp=True, ep=2), cuda=False,
                              te=False) is None
    fp8 = unsupported_reason(preset("tiny-gpt"), Layout(world_size=2, cp=2, precision="fp8"), cuda=False, te=False)
    assert fp8 is not None and "precision fp8" in fp8
    # MLA runs on the CPU, but not with CP (its proxy keeps the MLA structure at CPU size).
    mla = unsupported_reason(proxy(preset("deepseek-v2-lite")), Layout(world_size=2, cp=2), cuda=False, te=False)
    assert mla is not None and "multi_latent_attention with context parallel (cp=2)" in mla


def test_local_spec_swaps_only_what_the_layout_needs() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from sweeper.backends.megatron.build import transformer_config
    from sweeper.backends.megatron.cpu.attention import ContextParallelDotProductAttention
    from sweeper.backends.megatron.cpu.norm import SequenceParallelTorchNorm
    from sweeper.backends.megatron.cpu.spec import adapt_local_block_spec

    spec = preset("tiny-gpt")

    def adapted(layout: Layout) -> Any:
        config = transformer_config(spec, layout, cuda=False, te=False)
        # The block spec build.py gets, without the pipeline slicing (which needs initialised parallel state).
        layers = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=spec.normalization)
        block = TransformerBlockSubmodules(layer_specs=layers, layer_norm=WrappedTorchNorm)
        return block, adapt_local_block_spec(block, config)

    block, same = adapted(Layout(world_size=2, tp=2))
    assert same is block
    original, block = adapted(Layout(world_size=4, tp=2, cp=2, sp=True))
    for layer in block.layer_specs:
        attention = layer.submodules.self_attention.submodules
        assert attention.core_attention is ContextParallelDotProductAttention
        assert layer.submodules.input_layernorm is SequenceParallelTorchNorm
        assert layer.submodules.pre_mlp_layernorm is SequenceParallelTorchNorm
    assert block.layer_norm is SequenceParallelTorchNorm
    # Megatron's own spec objects are left untouched (a later CP1 build in the same process gets the originals).
    assert original.layer_specs[0].submodules.self_attention.submodules.core_attention is DotProductAttention
    assert original.layer_norm is WrappedTorchNorm


# --------------------------------------------------------------------------------------------------------------
# e2e: smoke trials through run_rank


def _request(tmp_path: Path, layout: Layout, model: str = "tiny-gpt", **kw: Any) -> SmokeRequest:
    base: dict[str, Any] = dict(
        model=preset(model), layout=layout, seq_length=32, steps=3, warmup_steps=1,
        checkpoint=True, checkpoint_every=None, trial_dir=str(tmp_path / "trial"), seed=1234, timeout_s=90.0,
    )
    base.update(kw)
    return SmokeRequest(**base)


def _passed(request: SmokeRequest, world: int) -> list[RankReport]:
    reports = run_ranks(request, world)
    assert all(r is not None for r in reports), f"a rank died or hung: {reports}"
    for r in reports:
        assert r.ok, f"rank {r.rank}: [{r.failure_kind}] {r.error}"
        assert r.checks.forward_backward and r.checks.finite
        assert len(r.losses) == request.steps and all(math.isfinite(x) for x in r.losses + r.grad_norms)
        if request.checkpoint:
            assert r.checks.checkpoint_saved and r.checks.checkpoint_reloaded
    assert all(r.losses == reports[0].losses for r in reports)  # identical on every rank
    assert reports[0].losses[0] == pytest.approx(math.log(256), abs=0.3)
    return reports  # type: ignore[return-value]


@pytest.mark.e2e
def test_cp2_trial_equals_cp1_trial(tmp_path: Path) -> None:
    """The proof on the whole model: same weights, same batches, fp32 — CP2 must train exactly like CP1."""
    cp1 = _passed(_request(tmp_path / "cp1", Layout(world_size=1, gbs=2, precision="fp32"), checkpoint=False), 1)
    cp2 = _passed(_request(tmp_path / "cp2", Layout(world_size=2, cp=2, gbs=2, precision="fp32")), 2)
    for step, (a, b) in enumerate(zip(cp1[0].losses, cp2[0].losses), start=1):
        assert abs(b - a) <= 1e-4 * abs(a), f"step {step}: CP1 loss {a} vs CP2 loss {b}"
    for step, (a, b) in enumerate(zip(cp1[0].grad_norms, cp2[0].grad_norms), start=1):
        assert abs(b - a) <= 1e-4 * abs(a), f"step {step}: CP1 grad norm {a} vs CP2 grad norm {b}"


@pytest.mark.e2e
def test_tp2_sp_trial(tmp_path: Path) -> None:
    _passed(_request(tmp_path, Layout(world_size=2, tp=2, sp=True, gbs=2)), 2)


@pytest.mark.e2e
def test_moe_tp2_sp_ep2_trial(tmp_path: Path) -> None:
    # Megatron refuses MoE with TP>1 unless SP is on: with SP on the CPU, this layout runs at all.
    _passed(_request(tmp_path, Layout(world_size=2, tp=2, sp=True, ep=2, gbs=2), "tiny-moe"), 2)


@pytest.mark.e2e
def test_alltoall_and_allgather_dispatchers_train_alike(tmp_path: Path) -> None:
    """Issue 18: the alltoall dispatcher (every MoE trial's default) runs on gloo and trains exactly as the
    allgather one: same routing, same experts, only the exchange differs (fp32, EP2 and TP2-SP-EP2)."""
    for name, layout in (("ep2", Layout(world_size=2, ep=2, gbs=2, precision="fp32")),
                         ("tp2ep2", Layout(world_size=2, tp=2, sp=True, ep=2, gbs=2, precision="fp32"))):
        runs = {}
        for dispatcher in ("alltoall", "allgather"):
            lo = dataclasses.replace(layout, moe_token_dispatcher=dispatcher)
            runs[dispatcher] = _passed(_request(tmp_path / f"{name}-{dispatcher}", lo, "tiny-moe",
                                                checkpoint=False), 2)[0]
        assert runs["alltoall"].losses == runs["allgather"].losses, name
        assert runs["alltoall"].grad_norms == pytest.approx(runs["allgather"].grad_norms, rel=1e-6), name


@pytest.mark.e2e
def test_tp2_cp2_four_ranks_trial(tmp_path: Path) -> None:
    _passed(_request(tmp_path, Layout(world_size=4, tp=2, cp=2, sp=True, gbs=2)), 4)
