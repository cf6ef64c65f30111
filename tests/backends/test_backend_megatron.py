"""The megatron-core backend: real ranks on gloo/CPU (e2e) plus unit tests of its pure parts.

The e2e cases run ``run_rank`` in W real processes (tests/backends/megatron_ranks.py, no Ray) on tiny models for a few
steps and check what every rank reports: same loss on all ranks, finite values, checkpoint written and read
back bitwise, and the failure kind plus a one-line reason when a layout cannot run.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import pytest

from sweeper.backends.base import RankReport, SmokeRequest
from sweeper.backends.megatron import releases
from sweeper.backends.megatron.failures import CheckpointError, NonFiniteError, SimulatedOOMError, classify, one_line
from sweeper.backends.megatron.support import unsupported_reason
from sweeper.config import megatron_release
from sweeper.estimate.step_time import model_flops_per_token
from sweeper.models.catalog import preset
from sweeper.models.params import padded_vocab_size
from sweeper.models.spec import ModelSpec
from sweeper.plan.rules import EXPERT_GRADS_FIXED_IN
from sweeper.record.schema import FAILURE_KINDS
from sweeper.space.layout import Layout

# --------------------------------------------------------------------------------------------------------------
# helpers


# A DeepSeek-V2-Lite-shaped model at CPU size: MLA (no query compression, latent KV, decoupled RoPE key, YaRN),
# first layer dense, then MoE with shared experts.
TINY_MLA = ModelSpec(
    name="tiny-mla", num_layers=3, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=256,
    max_position_embeddings=256, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=64, moe_first_k_dense=1, multi_latent_attention=True, qk_layernorm=True,
    q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
)


# A Nemotron-H-shaped hybrid at CPU size: Mamba2, attention (GQA), MoE with a shared expert, relu2 MLPs.
TINY_HYBRID = ModelSpec(
    name="tiny-hybrid", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
    vocab_size=256, max_position_embeddings=256, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=64, hybrid_layer_pattern="M*ME", mamba_num_heads=8, mamba_head_dim=16,
    mamba_num_groups=2, mamba_state_dim=16, gated_linear_unit=False,
)


def _request(tmp_path: Path, layout: Layout, model: ModelSpec | str = "tiny-gpt", **kw: object) -> SmokeRequest:
    spec = preset(model) if isinstance(model, str) else model
    base: dict = dict(
        model=spec, layout=layout, seq_length=32, steps=3, warmup_steps=1,
        checkpoint=False, checkpoint_every=None, trial_dir=str(tmp_path / "trial"), seed=1234, timeout_s=90.0,
    )
    base.update(kw)
    return SmokeRequest(**base)


def _run_raw(request: SmokeRequest, world: int, timeout_s: float = 240.0) -> list[RankReport | None]:
    sys.path.insert(0, str(Path(__file__).parent))  # the rank-spawning helper lives next to this file
    from megatron_ranks import run_ranks

    return run_ranks(request, world, timeout_s=timeout_s)


def _run(request: SmokeRequest, world: int) -> list[RankReport]:
    reports = _run_raw(request, world)
    assert all(r is not None for r in reports), f"a rank died or hung: {reports}"
    return reports  # type: ignore[return-value]


def _assert_passed(reports: list[RankReport], steps: int = 3) -> None:
    for r in reports:
        assert r.ok, f"rank {r.rank}: [{r.failure_kind}] {r.error}"
        assert r.backend == "megatron-core-cpu" and r.memory_kind == "host"
        assert r.checks.process_group and r.checks.model_built
        assert r.checks.forward_backward and r.checks.finite
        assert len(r.losses) == len(r.grad_norms) == len(r.step_times_s) == steps
        assert all(math.isfinite(x) for x in r.losses + r.grad_norms)
        assert r.peak_memory_bytes > 100 * 2**20
        assert r.flops_per_step > 0 and r.tokens_per_step > 0
        assert {"init", "build", "steps"} <= set(r.timings_s)
        # None: nothing is replicated (one rank, or PP alone with untied embeddings).
        assert r.checks.replicas_consistent is not False
    # Every rank reports the same loss and gradient norm per step (shared from the last stage / global norm).
    assert all(r.losses == reports[0].losses for r in reports)
    assert all(r.grad_norms == pytest.approx(reports[0].grad_norms, rel=1e-5) for r in reports)
    # Random tokens over a 256-token vocabulary: the loss of a freshly initialised model is about ln(256).
    assert reports[0].losses[0] == pytest.approx(math.log(256), abs=0.3)


def _assert_failed(reports: list[RankReport], kind: str) -> None:
    for r in reports:
        assert not r.ok
        assert r.failure_kind == kind, f"rank {r.rank}: [{r.failure_kind}] {r.error}"
        assert r.error and "\n" not in r.error


# --------------------------------------------------------------------------------------------------------------
# e2e: real megatron-core ranks on gloo


@pytest.mark.e2e
def test_dense_tp2(tmp_path: Path) -> None:
    reports = _run(_request(tmp_path, Layout(world_size=2, tp=2, gbs=2)), 2)
    _assert_passed(reports)
    assert all(r.checks.replicas_consistent for r in reports)  # the norms are copies on both TP ranks
    assert reports[0].tokens_per_step == 2 * 32
    assert (tmp_path / "trial" / "rank_0.log").read_text().count("step ") >= 3


@pytest.mark.e2e
def test_pp2(tmp_path: Path) -> None:
    _assert_passed(_run(_request(tmp_path, Layout(world_size=2, pp=2, gbs=4)), 2))


@pytest.mark.e2e
def test_dp2_same_numbers_with_and_without_distributed_optimizer(tmp_path: Path) -> None:
    runs = {}
    for distributed_optimizer in (True, False):
        layout = Layout(world_size=2, gbs=4, distributed_optimizer=distributed_optimizer)
        runs[distributed_optimizer] = _run(_request(tmp_path / str(distributed_optimizer), layout), 2)
        _assert_passed(runs[distributed_optimizer])
        assert all(r.checks.replicas_consistent for r in runs[distributed_optimizer])
    # Same data and initialisation: sharding the optimizer state must not change the training numbers.
    assert runs[True][0].losses == pytest.approx(runs[False][0].losses, rel=1e-4)
    assert runs[True][0].grad_norms == pytest.approx(runs[False][0].grad_norms, rel=1e-3)


@pytest.mark.e2e
def test_moe_ep2_with_routing_stress(tmp_path: Path) -> None:
    reports = _run(_request(tmp_path, Layout(world_size=2, ep=2, gbs=4), "tiny-moe", routing_stress_steps=1), 2)
    _assert_passed(reports)
    # The router's load on the two EP ranks, measured over the EP group: both ranks agree on it, and it lies
    # between even (1) and everything on one rank (EP x min(top-k, local experts) / top-k).
    spec = preset("tiny-moe")
    bound = 2 * min(spec.moe_router_topk, spec.num_moe_experts // 2) / spec.moe_router_topk
    factors = {r.moe_hot_rank_factor for r in reports}
    assert len(factors) == 1 and 1.0 <= factors.pop() <= bound
    # Routing stress (issue 17), after the normal steps: forcing the router onto EP rank 0's two experts sends
    # every token's top-2 there (factor = the bound, 2); onto expert 0 alone, each token's first choice is rank 0
    # and its second is its own, so rank 0 gets more than half of the routed tokens. Each rank measured its peak.
    for r in reports:
        stress = r.routing_stress
        assert stress is not None and set(stress) == {"hot_expert", "hot_rank"}
        assert stress["hot_rank"]["hot_rank_factor"] == pytest.approx(bound)
        assert 1.0 < stress["hot_expert"]["hot_rank_factor"] < bound
        assert all(s["finite"] and s["peak_memory_bytes"] > 100 * 2**20 for s in stress.values())
    assert len(reports[0].losses) == 3  # the stress steps are not the trial's steps


@pytest.mark.e2e
def test_expert_replicas_that_drift_apart_are_reported_as_divergence(tmp_path: Path) -> None:
    # TP2 with ETP1 and EP1: megatron-core 0.16.1 reduces the experts' gradients over the (size 1) data-parallel
    # group although both TP ranks hold a copy (rules.expert_grads_reduced_over_expert_dp refuses it before launch;
    # the backend runs what it is given). The copies differ after one step: the smoke run must say so.
    layout = Layout(world_size=2, tp=2, sp=True, gbs=2, precision="fp32")
    reports = _run(_request(tmp_path, layout, "tiny-moe", steps=2, checkpoint=True), 2)
    if megatron_release.installed() >= EXPERT_GRADS_FIXED_IN:
        # NVIDIA/Megatron-LM#5916's fix: the experts' gradients reduced over expert DP, the copies stay equal.
        _assert_passed(reports, steps=2)
        assert all(r.checks.replicas_consistent for r in reports)
        return
    _assert_failed(reports, "replica_divergence")
    for r in reports:
        assert "mlp.experts.local_experts" in r.error and "expert-data-parallel group (global ranks [0, 1])" in r.error
        # The cause named, Megatron's (tests/backends/test_expert_grads_etp.py locates it per gradient).
        assert "Megatron reduced the expert gradients over the data-parallel group" in r.error
        assert "NVIDIA/Megatron-LM#5916" in r.error and "expert_grads_reduced_over_expert_dp" in r.error
        assert r.error == reports[0].error  # one verdict on every rank
        assert all(getattr(r.checks, k) for k in ("process_group", "model_built", "forward_backward", "finite"))
        assert r.checks.replicas_consistent is False and r.checks.checkpoint_saved is False


@pytest.mark.e2e
def test_expert_replicas_stay_equal_when_etp_equals_tp(tmp_path: Path) -> None:
    layout = Layout(world_size=2, tp=2, etp=2, sp=True, gbs=2, precision="fp32")
    reports = _run(_request(tmp_path, layout, "tiny-moe", steps=3), 2)
    _assert_passed(reports)
    assert all(r.checks.replicas_consistent for r in reports)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "layout",
    [
        Layout(world_size=2, tp=2, etp=2, sp=True, gbs=2),
        Layout(world_size=2, pp=2, gbs=4, first_stage_layers=2, last_stage_layers=1),  # uneven, like 14/13
        Layout(world_size=2, ep=2, gbs=4),
    ],
    ids=["tp2-sp", "pp2-uneven", "ep2"],
)
def test_mla_trains_on_the_cpu(tmp_path: Path, layout: Layout) -> None:
    model = TINY_MLA
    refused = unsupported_reason(model, layout, cuda=False, te=False)
    if megatron_release.installed() >= releases.MLA_Q_NORM_FUSED:
        # 0.19 fuses the query norm of MLA without a query LoRA into a TE layer: refused on the CPU, and the
        # query-compressed MLA (DeepSeek-V3's) trains instead.
        assert refused is not None and "fused into q_proj, a Transformer Engine layer" in refused
        model = TINY_MLA.model_copy(update=dict(q_lora_rank=32))
        refused = unsupported_reason(model, layout, cuda=False, te=False)
    assert refused is None
    reports = _run(_request(tmp_path, layout, model, checkpoint=True), 2)
    _assert_passed(reports)
    assert all(r.checks.checkpoint_reloaded for r in reports)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "layout",
    [
        Layout(world_size=2, tp=2, etp=2, sp=True, gbs=2),  # Mamba heads and groups split over TP
        Layout(world_size=2, pp=2, gbs=4),
        Layout(world_size=2, ep=2, gbs=4),
        Layout(world_size=2, cp=2, gbs=2),  # Megatron's Mamba context parallelism (all-to-all over heads)
    ],
    ids=["tp2-sp", "pp2", "ep2", "cp2"],
)
def test_hybrid_mamba_trains_on_the_cpu(tmp_path: Path, layout: Layout) -> None:
    reports = _run(_request(tmp_path, layout, TINY_HYBRID, checkpoint=True), 2)
    _assert_passed(reports)
    assert all(r.checks.checkpoint_reloaded for r in reports)


@pytest.mark.e2e
def test_tp2_pp2_four_ranks_with_checkpoint(tmp_path: Path) -> None:
    reports = _run(_request(tmp_path, Layout(world_size=4, tp=2, pp=2, gbs=4), checkpoint=True), 4)
    _assert_passed(reports)
    assert all(r.checks.checkpoint_saved and r.checks.checkpoint_reloaded for r in reports)


@pytest.mark.e2e
def test_vpp2_on_pp2(tmp_path: Path) -> None:
    _assert_passed(_run(_request(tmp_path, Layout(world_size=2, pp=2, vpp=2, gbs=4)), 2))


@pytest.mark.e2e
def test_uneven_pipeline_split(tmp_path: Path) -> None:
    five_layers = preset("tiny-gpt").model_copy(update={"num_layers": 5})
    layout = Layout(world_size=2, pp=2, gbs=4, first_stage_layers=3, last_stage_layers=2)
    _assert_passed(_run(_request(tmp_path, layout, five_layers), 2))


@pytest.mark.e2e
def test_checkpoint_saved_every_n_and_reloaded_bitwise(tmp_path: Path) -> None:
    request = _request(tmp_path, Layout(world_size=2, tp=2, gbs=2, recompute="full"), steps=4,
                       checkpoint=True, checkpoint_every=2)
    reports = _run(request, 2)
    _assert_passed(reports, steps=4)
    for r in reports:
        assert r.checks.checkpoint_saved is True and r.checks.checkpoint_reloaded is True
        assert r.checkpoint_dir == str(tmp_path / "trial" / "checkpoint" / "iter_0000004")
        assert {"checkpoint_save", "checkpoint_load"} <= set(r.timings_s)
    for step in (2, 4):
        directory = tmp_path / "trial" / "checkpoint" / f"iter_{step:07d}"
        assert (directory / "metadata.json").exists() and list(directory.glob("*.distcp"))


@pytest.mark.e2e
@pytest.mark.parametrize("keep", [False, True], ids=["deleted", "kept"])
def test_checkpoint_is_deleted_after_its_bitwise_reload_unless_kept(tmp_path: Path, keep: bool) -> None:
    # Issue 43: two saves (steps 1 and 2), each reloaded bitwise; then rank 0 measures the folder and, unless the
    # request keeps it, deletes it once both ranks have read it back. The trial passes either way.
    request = _request(tmp_path, Layout(world_size=2, tp=2, gbs=2), steps=2, checkpoint=True, checkpoint_every=1,
                       keep_checkpoint=keep)
    reports = _run(request, 2)
    _assert_passed(reports, steps=2)
    folder = tmp_path / "trial" / "checkpoint"
    assert all(r.checks.checkpoint_saved and r.checks.checkpoint_reloaded for r in reports)
    assert all(r.checkpoint_dir == str(folder / "iter_0000002") for r in reports)
    rank0, rank1 = reports
    assert rank0.checkpoint_bytes is not None and rank0.checkpoint_bytes > 0 and rank1.checkpoint_bytes is None
    assert (rank0.checkpoint_deleted, rank1.checkpoint_deleted) == (not keep, False)
    assert not [n for n in rank0.notes if n.startswith("checkpoint kept")]
    assert (tmp_path / "trial" / "rank_1.log").is_file()  # only the checkpoint goes
    if keep:
        from sweeper.record.checkpoints import folder_bytes

        assert all((folder / f"iter_{step:07d}" / "metadata.json").is_file() for step in (1, 2))
        assert folder_bytes(folder) == rank0.checkpoint_bytes
    else:
        assert not folder.exists()


@pytest.mark.e2e
def test_selective_recompute_modules_train_the_same_model(tmp_path: Path) -> None:
    """Megatron's moe recompute module (the whole MoE layer re-run in backward) changes memory, not the maths:
    the same losses as without recompute. Output-discarding modules need TE and are reported unsupported."""
    plain = _run(_request(tmp_path / "none", Layout(world_size=2, ep=2, gbs=4), "tiny-moe"), 2)
    moe = _run(_request(tmp_path / "moe", Layout(world_size=2, ep=2, gbs=4, recompute="selective:moe"), "tiny-moe"), 2)
    _assert_passed(plain)
    _assert_passed(moe)
    assert moe[0].losses == pytest.approx(plain[0].losses, rel=1e-6)
    layernorm = _run(_request(tmp_path / "ln", Layout(world_size=1, gbs=2, recompute="selective:layernorm")), 1)
    _assert_failed(layernorm, "unsupported")
    assert "recompute module layernorm unsupported on this backend" in layernorm[0].error


@pytest.mark.e2e
def test_megatron_rejects_heads_not_divisible_by_tp(tmp_path: Path) -> None:
    six_heads = preset("tiny-gpt").model_copy(update={"hidden_size": 96, "num_attention_heads": 6})
    reports = _run(_request(tmp_path, Layout(world_size=4, tp=4, gbs=4), six_heads), 4)
    _assert_failed(reports, "invalid_layout")
    assert "num_attention_heads (6)" in reports[0].error and "tensor_model_parallel_size (4)" in reports[0].error
    assert all(r.checks.process_group and not r.checks.model_built for r in reports)


@pytest.mark.e2e
def test_a_bug_in_sweeper_is_internal_not_the_layouts_fault(tmp_path: Path) -> None:
    reports = _run(_request(tmp_path, Layout(world_size=2, tp=2, gbs=2), inject="bug"), 2)
    _assert_failed(reports, "internal")
    for r in reports:
        assert r.error.startswith("sweeper bug at sweeper/backends/megatron/smoke.py:"), r.error
        assert "TypeError" in r.error and r.checks.process_group and not r.checks.model_built


def test_classification_by_origin_sweeper_megatron_torch() -> None:
    from sweeper.backends.megatron.build import transformer_config

    # Megatron's own check, reached through sweeper's build code: the layout's.
    six_heads = preset("tiny-gpt").model_copy(update={"hidden_size": 96, "num_attention_heads": 6})
    with pytest.raises(ValueError) as megatron:
        transformer_config(six_heads, Layout(world_size=4, tp=4), cuda=False, te=False)
    assert classify(megatron.value, "build")[0] == "invalid_layout"
    # A wrong call inside sweeper's build code: sweeper's, with its file and line.
    with pytest.raises(AttributeError) as bug:
        transformer_config(preset("tiny-gpt"), None, cuda=False, te=False)  # type: ignore[arg-type]
    kind, error = classify(bug.value, "build")
    assert kind == "internal" and error.startswith("sweeper bug at sweeper/backends/megatron/build.py:")
    # An OSError (a full disk) is the environment's wherever it is raised.
    assert classify(OSError("No space left on device"), "checkpoint_save")[0] == "checkpoint_error"
    # A peer that died during the save's or load's collectives (a node lost): collateral, not the checkpoint's.
    lost = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:14211: "
                        "Connection reset by peer")
    assert classify(lost, "checkpoint_load") == ("comm_error", "checkpoint load failed: Read error "
                                                 "[127.0.0.1]:14211: Connection reset by peer")


@pytest.mark.e2e
def test_injected_nan_is_caught_on_every_rank(tmp_path: Path) -> None:
    reports = _run(_request(tmp_path, Layout(world_size=2, pp=2, gbs=4), inject="nan", inject_rank=0), 2)
    _assert_failed(reports, "nan")
    for r in reports:
        assert math.isfinite(r.losses[0]) and math.isnan(r.losses[1]) and len(r.losses) == 2
        assert "step 2" in r.error


@pytest.mark.e2e
@pytest.mark.parametrize("inject", ["crash", "hang"])
def test_injected_crash_or_hang_surfaces_as_comm_error_on_the_peer(tmp_path: Path, inject: str) -> None:
    # The process-group timeout bounds how long the healthy rank waits for the hung one.
    request = _request(tmp_path, Layout(world_size=2, pp=2, gbs=4), inject=inject, inject_rank=0, timeout_s=5.0)
    reports = _run_raw(request, 2, timeout_s=20.0)
    assert reports[0] is None  # exited with code 17 / blocked forever (killed by the helper)
    peer = reports[1]
    assert peer is not None and not peer.ok and peer.failure_kind == "comm_error", peer
    assert len(peer.losses) == 1 and "\n" not in peer.error and not peer.error.startswith("[")


@pytest.mark.e2e
def test_unsupported_feature_fails_before_anything_heavy(tmp_path: Path) -> None:
    # FP8 needs Transformer Engine on a GPU (SP and CP run on the CPU since tests/backends/test_cpu_parallel.py).
    reports = _run(_request(tmp_path, Layout(world_size=2, tp=2, gbs=2, precision="fp8")), 2)
    _assert_failed(reports, "unsupported")
    assert "unsupported on this backend (megatron-core-cpu)" in reports[0].error
    assert not reports[0].checks.process_group and "init" not in reports[0].timings_s


@pytest.mark.e2e
def test_memory_limit_stops_the_rank_as_oom(tmp_path: Path) -> None:
    reports = _run(_request(tmp_path, Layout(world_size=2, tp=2, gbs=2), memory_limit_gib=0.05), 2)
    _assert_failed(reports, "oom")
    assert "exceeded the simulated GPU memory of 0.05 GiB" in reports[0].error
    assert reports[0].peak_memory_bytes > 0.05 * 2**30


def test_the_memory_watchdog_stops_a_rank_already_past_the_limit_before_it_blocks() -> None:
    """A rank over the limit when the watchdog is armed fails at once in its own thread. The sampling thread's first
    look could come after the rank entered the rendezvous (a C call an asynchronous raise cannot interrupt): the
    rank then exited after the grace period with no report (CI, stop 57: rank 0 None, rank 1 oom)."""
    import psutil

    from sweeper.backends.megatron.memory import MemoryWatchdog

    rss = psutil.Process().memory_info().rss
    watchdog = MemoryWatchdog(rss // 2, interval_s=60.0)  # the sampling thread would look only after a minute
    try:
        with pytest.raises(SimulatedOOMError, match="exceeded the simulated GPU memory"):
            watchdog.start()
    finally:
        watchdog.stop()
    assert watchdog.exceeded_bytes and watchdog.exceeded_bytes > rss // 2


def test_the_memory_watchdog_interrupts_a_rank_that_crosses_the_limit_while_running() -> None:
    """Under the limit when armed, past it later: the sampling thread raises in the running thread at its next
    bytecode."""
    import time

    import psutil
    import torch

    from sweeper.backends.megatron.memory import MemoryWatchdog

    watchdog = MemoryWatchdog(psutil.Process().memory_info().rss + 64 * 2**20).start()
    held = []
    try:
        with pytest.raises(SimulatedOOMError):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                held.append(torch.ones(8 * 2**20 // 4))  # 8 MiB at a time, up to ~2.5 GiB in 20 s
                time.sleep(0.002)
                if len(held) > 320:
                    held.clear()
    finally:
        watchdog.stop()
        held.clear()
    assert watchdog.exceeded_bytes is not None


# --------------------------------------------------------------------------------------------------------------
# unit: the steps' peak memory


@pytest.mark.parametrize("kernel_resets", [True, False], ids=["reset", "reset-refused"])
def test_the_steps_peak_on_the_cpu_leaves_out_what_came_before_the_steps(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kernel_resets: bool) -> None:
    """Issue 44: the CPU backend's peak is the process's resident set; a peak before the steps (build, the
    reference load, the gate: here 256 MiB held and freed) is the peak before the steps, not the steps' peak.
    Where the kernel refuses the reset (``/proc/self/clear_refs`` not writable: stood in for by a path in a
    missing folder), the figure stays the peak since the process started and says so (``resettable`` False)."""
    import torch

    from sweeper.backends.megatron import memory
    from sweeper.backends.megatron.memory import StepsPeak, reset_resident_high_water, resident_high_water_bytes

    if not kernel_resets:
        monkeypatch.setattr(memory, "_CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    assert reset_resident_high_water() is kernel_resets  # this machine's kernel allows the reset (CI's too)
    big = torch.ones(256 * 2**20 // 4)
    held = resident_high_water_bytes()
    del big
    steps = StepsPeak(cuda=False)
    step = torch.ones(8 * 2**20 // 4)  # what a step holds
    assert steps.resettable is kernel_resets
    # The kernel's resident-set counters are approximate to a few pages per CPU.
    assert steps.before_bytes > held - 8 * 2**20
    if kernel_resets:
        assert steps.peak_bytes() < held - 128 * 2**20, (steps.peak_bytes(), held)
    else:
        assert steps.peak_bytes() >= held - 8 * 2**20, (steps.peak_bytes(), held)
    del step


# --------------------------------------------------------------------------------------------------------------
# unit: failure classification


def test_classification_of_megatron_layout_assertions() -> None:
    """Megatron's own validation while building is the layout's: an assert in TransformerConfig.__post_init__, and
    parallel_state's RuntimeError on parallel sizes that do not divide the world."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    with pytest.raises((AssertionError, ValueError)) as asserted:  # an assert up to 0.16, a ValueError from 0.19
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, moe_ffn_hidden_size=32)
    assert classify(asserted.value, "build") == ("invalid_layout", str(asserted.value))
    created = not torch.distributed.is_initialized()
    if created:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    try:
        world = torch.distributed.get_world_size()
        with pytest.raises(RuntimeError) as sizes:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=world + 1)
    finally:
        if created:
            torch.distributed.destroy_process_group()
    assert classify(sizes.value, "build") == ("invalid_layout", f"world_size ({world}) is not divisible by {world + 1}")


def test_a_cuda_te_or_nccl_error_while_building_is_not_the_layouts() -> None:
    """Issue 44: any RuntimeError while building was invalid_layout, so a Transformer Engine, CUDA or NCCL failure
    marked a region of the space infeasible. Now only Megatron's validation is; the rest is infra with its line."""
    import torch
    from megatron.core.transformer.utils import get_default_causal_mask

    # torch failing inside a call megatron-core made (no GPU here: its CUDA mask cannot be made; with the CPU
    # backend's device mode installed, the negative size is refused instead): not a raise of Megatron's.
    with pytest.raises((AssertionError, RuntimeError)) as inside:
        get_default_causal_mask(-1)
    kind, error = classify(inside.value, "build")
    assert kind == "infra" and error.startswith(type(inside.value).__name__), error
    assert "(raised in " in error and "\n" not in error

    def te_module_init() -> None:  # a stand-in for Transformer Engine's C++ check failing in a module's __init__
        raise RuntimeError("/TransformerEngine/transformer_engine/common/gemm/cublaslt_gemm.cu:412 in function "
                           "cublas_gemm: cuBLAS Error: the requested functionality is not supported")

    with pytest.raises(RuntimeError) as te:
        te_module_init()
    kind, error = classify(te.value, "build")
    assert kind == "infra" and "cuBLAS Error: the requested functionality is not supported" in error
    assert "test_backend_megatron.py:" in error  # where it was raised
    cuda = RuntimeError("CUDA error: no kernel image is available for execution on the device")
    assert classify(cuda, "build") == ("infra", "RuntimeError: CUDA error: no kernel image is available for execution "
                                                "on the device")
    nccl = torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1935, invalid usage")
    assert classify(nccl, "build")[0] == "comm_error"
    # Not Megatron's assert either: an AssertionError or ValueError without a raise in megatron-core.
    assert classify(ValueError("bad value"), "build")[0] == "infra"


def test_a_combination_megatron_core_does_not_implement_is_unsupported() -> None:
    from megatron.core.transformer import MLATransformerConfig

    with pytest.raises(NotImplementedError) as info:
        MLATransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, attention_output_gate=True)
    kind, error = classify(info.value, "build")
    assert kind == "unsupported" and error.startswith("not implemented in megatron-core: Output gate is not supported")
    assert "megatron/core/transformer/transformer_config.py:" in error


def test_classification_of_rules_megatron_checks_at_first_forward() -> None:
    exc = ValueError("During training, performance may degrade if MoE and tensor parallelism are enabled without "
                     "also enabling sequence parallelism.")
    assert classify(exc, "steps")[0] == "invalid_layout"
    assert classify(RuntimeError("shape '[4, 32, 2, 16]' is invalid for input of size 4000"), "steps")[0] == \
        "invalid_layout"


def test_classification_of_oom_comm_nan_checkpoint() -> None:
    import torch

    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "steps")[0] == "oom"
    assert classify(RuntimeError("CUDA out of memory. Tried to allocate 20 MiB"), "build")[0] == "oom"
    assert classify(SimulatedOOMError("resident host memory 3 GiB exceeded"), "steps")[0] == "oom"
    for allocator in ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                      "cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "CUDA driver error: CUDA_ERROR_OUT_OF_MEMORY",
                      "cudaErrorMemoryAllocation: out of memory in the NCCL buffer"):
        assert classify(RuntimeError(allocator), "steps")[0] == "oom", allocator
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:2")
    assert classify(gloo, "steps") == ("comm_error", "Connection closed by peer [10.0.0.2]:2")
    assert classify(RuntimeError("Timed out waiting 90000ms for recv operation"), "steps")[0] == "comm_error"
    assert classify(torch.distributed.DistBackendError("NCCL error in: ..."), "steps")[0] == "comm_error"
    assert classify(NonFiniteError("loss is nan"), "steps") == ("nan", "loss is nan")
    kind, error = classify(OSError("No space left on device"), "checkpoint_save")
    assert kind == "checkpoint_error" and "save" in error
    assert classify(CheckpointError("differs"), "checkpoint_load")[0] == "checkpoint_error"
    assert classify(KeyError("x"), "steps")[0] == "infra"
    assert all(classify(e, "steps")[0] in FAILURE_KINDS for e in (ValueError("a"), MemoryError(), gloo))


def test_error_is_one_line() -> None:
    assert one_line(RuntimeError("first line\n  traceback noise\nmore")) == "first line"
    assert one_line(AssertionError()) == "AssertionError (Megatron gave no message)"
    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging. GLHF!")
    assert one_line(gloo) == "Read error [127.0.0.1]:1: Connection reset by peer."
    assert len(one_line(RuntimeError("x" * 5000))) <= 400


# --------------------------------------------------------------------------------------------------------------
# unit: what the CPU backend supports


@pytest.mark.parametrize(
    ("model", "layout", "needle"),
    [
        ("tiny-gpt", Layout(world_size=2, tp=2, sp=True, precision="fp8"), "precision fp8"),
        ("tiny-gpt", Layout(world_size=1, precision="mxfp8"), "precision mxfp8"),
        (TINY_MLA, Layout(world_size=2, cp=2), "multi_latent_attention with context parallel (cp=2)"),
    ],
)
def test_cpu_backend_reports_unsupported_features(model: str | ModelSpec, layout: Layout, needle: str) -> None:
    reason = unsupported_reason(preset(model) if isinstance(model, str) else model, layout, cuda=False, te=False)
    assert reason is not None and needle in reason and "unsupported on this backend (megatron-core-cpu)" in reason


def test_cpu_backend_runs_the_flagship_architectures_at_cpu_size() -> None:
    # Hybrid Mamba (torch Mamba2 kernels) and MLA (local spec) build on the CPU; MLA with CP does not. From
    # megatron-core 0.19 an MLA model without a query LoRA and with qk_layernorm needs TE's fused norm+linear.
    layout = Layout(world_size=8, tp=2, pp=2, ep=2, sp=True)
    assert unsupported_reason(TINY_HYBRID, layout, cuda=False, te=False) is None
    mla = unsupported_reason(TINY_MLA, layout, cuda=False, te=False)
    if megatron_release.installed() >= releases.MLA_Q_NORM_FUSED:
        assert mla is not None and "fused into q_proj, a Transformer Engine layer" in mla
        mla = unsupported_reason(TINY_MLA.model_copy(update=dict(q_lora_rank=32)), layout, cuda=False, te=False)
    assert mla is None
    assert unsupported_reason(TINY_HYBRID, Layout(world_size=2, cp=2), cuda=False, te=False) is None
    # The production sizes are refused on the CPU with the way out, not left to swap the machine.
    reason = unsupported_reason(preset("nemotron-3-nano-30b-a3b"), Layout(world_size=8, ep=8), cuda=False, te=False)
    assert reason is not None and "B-parameter model unsupported on this backend" in reason and "--proxy" in reason


def test_cpu_backend_runs_plain_layouts() -> None:
    for precision in ("fp32", "fp16", "bf16"):
        layout = Layout(world_size=8, tp=2, pp=2, ep=2, precision=precision, recompute="full")
        assert unsupported_reason(preset("tiny-moe"), layout, cuda=False, te=False) is None
    # Context and sequence parallel run on the CPU through sweeper's local CP attention and SP norms.
    layout = Layout(world_size=8, tp=2, cp=2, sp=True, ep=2)
    assert unsupported_reason(preset("tiny-moe"), layout, cuda=False, te=False) is None


def test_gpu_with_transformer_engine_runs_sp_cp_fp8() -> None:
    layout = Layout(world_size=8, tp=2, cp=2, sp=True, precision="fp8")
    assert unsupported_reason(preset("tiny-gpt"), layout, cuda=True, te=True) is None


def test_layer_spec_choice() -> None:
    from sweeper.backends.megatron.build import use_transformer_engine

    assert use_transformer_engine(cuda=True, te_available=True)
    assert not use_transformer_engine(cuda=False, te_available=True)
    assert not use_transformer_engine(cuda=True, te_available=False)


# --------------------------------------------------------------------------------------------------------------
# unit: FLOPs


def _flops_per_step(spec: ModelSpec, s: int, b: int, vocab: int) -> float:
    return b * s * model_flops_per_token(spec, s, vocab)


def test_flops_dense_gqa_by_hand() -> None:
    spec = ModelSpec(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                     vocab_size=256)
    s, b, v = 32, 4, 256
    qkv = 64 * (64 + 2 * 32)  # q 4 heads x 16, k and v 2 groups x 16
    out = 64 * 64
    attn = s * 64  # QK^T and AV over half the causal sequence each
    mlp = 3 * 64 * 256  # SwiGLU: gate, up, down
    per_token = 2 * (2 * (qkv + out + attn + mlp) + 64 * v)
    assert _flops_per_step(spec, s, b, v) == 3 * b * s * per_token


def test_flops_match_megatron_closed_form() -> None:
    """Megatron-LM's expression: 12·s·b·L·h² [(1 + g/n + s/(2h))·(n·d/h) + ffn/h·glu] + 6·s·b·h·V (dense)."""
    spec = preset("llama3-8b")
    s, b = 4096, 8
    h, n, g, d, L = spec.hidden_size, spec.num_attention_heads, spec.query_groups, spec.head_dim, spec.num_layers
    v = padded_vocab_size(spec, tp=1)
    megatron = 12 * s * b * L * h * h * ((1 + g / n + s / h / 2) * (n * d / h) + spec.ffn_hidden_size / h * 1.5) \
        + 6 * s * b * h * v
    assert _flops_per_step(spec, s, b, v) == pytest.approx(megatron, rel=1e-12)


def test_flops_moe_counts_routed_topk_shared_router_and_first_dense() -> None:
    base = dict(num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, vocab_size=128)
    dense = ModelSpec(**base)
    moe = ModelSpec(**base, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                    moe_shared_expert_intermediate_size=64, moe_first_k_dense=1)
    s, b = 16, 2
    mlp_dense, mlp_moe = 3 * 64 * 256, 3 * 64 * (2 * 32 + 64) + 64 * 8  # the MoE layer: experts + router
    assert _flops_per_step(dense, s, b, 128) - _flops_per_step(moe, s, b, 128) == \
        pytest.approx(6 * s * b * 3 * (mlp_dense - mlp_moe))


def test_flops_of_one_mla_layer_by_hand() -> None:
    # DeepSeek-V2-Lite's attention (no query compression): h 2048, 16 heads, qk 128 + rope 64, v 128, kv rank 512.
    spec = preset("deepseek-v2-lite").model_copy(update=dict(num_layers=1, moe_first_k_dense=1, num_moe_experts=None,
                                                             moe_router_topk=None, moe_ffn_hidden_size=None,
                                                             moe_shared_expert_intermediate_size=None))
    s, h, a = 4096, 2048, 16
    q = h * a * (128 + 64)  # q_proj
    kv_down = h * (512 + 64)  # latent KV plus the shared rope key
    kv_up = 512 * a * (128 + 128)  # keys (no rope part) and values from the latent
    out = a * 128 * h
    core = s * a * (192 + 128) / 2  # QK^T over 192 dims, AV over 128, causal half
    mlp = 3 * h * 10944
    per_token_fwd = 2 * (q + kv_down + kv_up + out + core + mlp) + 2 * h * 102400
    assert model_flops_per_token(spec, s, 102400) == pytest.approx(3 * per_token_fwd, rel=1e-12)


def test_flops_of_one_mamba_layer_by_hand() -> None:
    # Nemotron-3-Nano's Mamba2 mixer alone: h 2688, 64 heads x 64, 8 groups, state 128, chunk 128.
    spec = ModelSpec(num_layers=1, hidden_size=2688, ffn_hidden_size=1856, num_attention_heads=32,
                     num_query_groups=2, vocab_size=131072, hybrid_layer_pattern="M", mamba_num_heads=64,
                     mamba_head_dim=64, mamba_num_groups=8, mamba_state_dim=128)
    s, h, d_inner = 4096, 2688, 64 * 64
    in_proj = h * (2 * d_inner + 2 * 8 * 128 + 64)  # z, x, B, C (per group), dt (per head)
    out_proj = d_inner * h
    scan = 7 * 128 * d_inner + 2 * 128 * d_inner  # state update/output/decay per state element + intra-chunk
    per_token_fwd = 2 * (in_proj + out_proj) + scan + 2 * h * 131072
    assert model_flops_per_token(spec, s, 131072) == pytest.approx(3 * per_token_fwd, rel=1e-12)


def test_padded_vocab() -> None:
    def padded(vocab: int, tp: int) -> int:
        return padded_vocab_size(ModelSpec(num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=1,
                                           vocab_size=vocab), tp)

    assert padded(256, tp=2) == 256
    assert padded(128256, tp=8) == 129024
    assert padded(100, tp=1) == 128


def test_an_nccl_error_names_nccls_last_error_and_an_nvml_refusal_is_the_nodes():
    """The failure seen on an H200 (forked warm ranks): NCCL's generic first line, its cause after "Last error:".
    Not a comm_error (no peer was lost, the layout is not at fault): infra, with the cause in the one line."""
    import torch

    exc = torch.distributed.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, unhandled system error (run with "
        "NCCL_DEBUG=INFO for details), NCCL version 2.28.9\nncclSystemError: System call (e.g. socket, malloc) or "
        "external library call failed or device error. \nLast error:\nnvmlInit_v2() failed: GPU access blocked by "
        "the operating system")
    kind, error = classify(exc, "build")
    assert kind == "infra"
    assert error.endswith("NCCL version 2.28.9; last error: nvmlInit_v2() failed: GPU access blocked by the "
                          "operating system")
    lost = torch.distributed.DistBackendError("NCCL error: remote process exited or there was a network error\n"
                                              "Last error:\nsocket recv: connection reset by peer")
    assert classify(lost, "steps") == ("comm_error", "NCCL error: remote process exited or there was a network "
                                       "error; last error: socket recv: connection reset by peer")
