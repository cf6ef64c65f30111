"""Megatron-FSDP trials on the CPU backend: real megatron-core ranks on gloo (tests/backends/megatron_ranks.py).

One FP32 reference per model on a single rank; then the same layout (DP2; TP2xDP2; tiny-moe EP2xDP4) with
Megatron's DDP (distributed optimizer) and with Megatron-FSDP, each through the whole smoke run: the equivalence gate (the reference loaded into the bare chunks
before Megatron-FSDP wraps them), 3 training steps with a checkpoint saved and reloaded after every step (FSDP:
Megatron-LM's fsdp_dtensor way, DCP of the distributed parameters, experts under global indices; every shard
poisoned, reloaded, compared bitwise), the replica check (with TP: the gathered weights TP does not shard, compared across the TP group).
Megatron-FSDP's first loss is bit-identical to DDP's, and the later ones agree to 1e-6: the reduce-scatter and the
distributed optimizer do the same arithmetic, but the gradient norm is summed in another order; with clipping active
(norm ~6 > clip 1.0) that moves a weight by an ulp now and then, so FP32 runs drift by an ulp or two of the loss
(measured: DP2 optim_grads at step 3, optim_grads_params at step 5 and, in one CI run, at step 3, TP2xDP2 optim at
step 3, EP2xDP4 at step 3; BF16 bitwise for 6 steps on DP2 and 3 on TP2xDP2 and EP2xDP4, every strategy). Unit tests pin what the CPU backend
refuses.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sweeper.backends.base import RankReport, SmokeRequest
from sweeper.backends.megatron.equivalence import tolerance
from sweeper.backends.megatron.support import unsupported_reason
from sweeper.models.catalog import preset
from sweeper.space.layout import Layout

SEQ = 32


def _request(trial_dir: Path, layout: Layout, model: str = "tiny-gpt", **kw: object) -> SmokeRequest:
    """Three steps with a checkpoint save and reload after each."""
    sys.path.insert(0, str(Path(__file__).parent))  # the rank-spawning helper lives next to this file
    from megatron_ranks import smoke_request

    return smoke_request(trial_dir, layout, model, SEQ, **{"steps": 3, "checkpoint": True, "checkpoint_every": 1,
                                                           **kw})


def _run(request: SmokeRequest, world: int) -> list[RankReport]:
    sys.path.insert(0, str(Path(__file__).parent))  # the rank-spawning helper lives next to this file
    from megatron_ranks import run_ranks

    reports = run_ranks(request, world, timeout_s=120.0)
    assert all(r is not None for r in reports), f"a rank died or hung: {reports}"
    for r in reports:
        assert r is not None and r.ok, f"rank {r and r.rank}: [{r and r.failure_kind}] {r and r.error}"
    return reports  # type: ignore[return-value]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """model -> its FP32 reference on one rank, made on first use."""
    made: dict[str, Path] = {}

    def get(model: str) -> Path:
        if model not in made:
            root = tmp_path_factory.mktemp(f"reference_{model}")
            made[model] = root / "reference"
            _run(_request(root / "trial", Layout(world_size=1, gbs=4, precision="fp32"), model, steps=0,
                          checkpoint=False, reference_checkpoint=str(made[model]), make_reference=True), 1)
        return made[model]

    return get


@pytest.mark.e2e
@pytest.mark.parametrize(("model", "strategy", "tp", "ep", "precision"), [
    ("tiny-gpt", "optim_grads_params", 1, 1, "fp32"),
    # 4 ranks each, DDP then FSDP: `pytest -m slow` (they keep .ci/run under its 40 minutes on 2 cores)
    pytest.param("tiny-gpt", "optim", 2, 1, "bf16", marks=pytest.mark.slow),
    pytest.param("tiny-moe", "optim_grads_params", 1, 2, "bf16", marks=pytest.mark.slow),
])
def test_fsdp_trial_passes_and_matches_ddp(tmp_path: Path, reference: Callable[[str], Path], model: str,
                                           strategy: str, tp: int, ep: int, precision: str) -> None:
    world = 2 * tp * ep
    runs = {}
    for fsdp in (None, strategy):
        layout = Layout(world_size=world, tp=tp, ep=ep, gbs=4, precision=precision, distributed_optimizer=True,
                        fsdp=fsdp)
        runs[fsdp] = _run(_request(tmp_path / str(fsdp), layout, model, reference_checkpoint=str(reference(model))), world)
    ddp, fsdp_reports = runs[None], runs[strategy]
    for r in fsdp_reports:
        assert r.checks.equivalence_rel_err is not None
        assert r.checks.equivalence_rel_err <= tolerance(precision, "fp32")
        assert r.reference_load and r.reference_load["tensors"], "the reference was loaded (before wrapping)"
        assert r.checks.finite and r.checks.checkpoint_saved and r.checks.checkpoint_reloaded
        # Across DP the gathered full weights are one tensor on every rank by construction (replicas.py): with DP
        # alone the check has nothing to compare; with TP it compares the weights TP does not shard.
        assert r.checks.replicas_consistent is (True if tp > 1 else None)
        assert (Path(r.checkpoint_dir or "") / ".metadata").is_file(), "a DCP (fsdp_dtensor) checkpoint"
    # The first loss bit-identical (the same weights, gathered, and the same data); then through two mid-run
    # save/poison/reload cycles equal to 1e-6: Megatron-FSDP sums the squared grad norm over other shards than the
    # distributed optimizer does, so the clip coefficient may differ in its last bit, and the next losses by an ulp
    # or two (seen at step 3 in FP32: 0x1.cb14a2p+2 against 0x1.cb14a0p+2).
    fsdp_losses, ddp_losses = fsdp_reports[0].losses, ddp[0].losses
    assert len(fsdp_losses) == len(ddp_losses) > 1
    assert fsdp_losses[0].hex() == ddp_losses[0].hex()
    for a, b in zip(fsdp_losses[1:], ddp_losses[1:], strict=True):
        assert math.isclose(a, b, rel_tol=1e-6)
    for a, b in zip(fsdp_reports[0].grad_norms, ddp[0].grad_norms, strict=True):
        assert math.isclose(a, b, rel_tol=1e-6)
    assert fsdp_reports[0].equivalence == pytest.approx(ddp[0].equivalence, rel=1e-6)


def test_cpu_backend_runs_fsdp_with_data_tensor_and_expert_parallelism() -> None:
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        for precision in ("fp32", "bf16"):
            for model, tp, ep in (("tiny-gpt", 1, 1), ("tiny-gpt", 2, 1), ("tiny-moe", 1, 1), ("tiny-moe", 1, 2)):
                layout = Layout(world_size=2 * tp * ep, tp=tp, ep=ep, gbs=4, precision=precision, fsdp=strategy)
                assert unsupported_reason(preset(model), layout, cuda=False, te=False) is None


@pytest.mark.parametrize(("kw", "why"), [
    (dict(world_size=4, tp=2, sp=True), "with sp"),
    (dict(world_size=4, pp=2), "pp=2"),
    (dict(world_size=4, cp=2), "cp=2"),
    (dict(world_size=4, pp=2, vpp=2), "pp=2, vpp=2"),
    (dict(world_size=2, precision="fp16"), "fp16"),
])
def test_cpu_backend_refuses_unverified_fsdp_combinations(kw: dict, why: str) -> None:
    layout = Layout(gbs=4, **{"precision": "fp32", **kw}, fsdp="optim")
    reason = unsupported_reason(preset("tiny-gpt"), layout, cuda=False, te=False)
    assert reason is not None and reason.startswith("fsdp optim (Megatron-FSDP) unsupported on this backend "
                                                    "(megatron-core-cpu)")
    assert why in reason


@pytest.mark.parametrize(("kw", "why"), [
    (dict(world_size=4, ep=2, etp=2), "etp=2"),
    (dict(world_size=8, tp=2, ep=2), "tp=2 on an MoE model"),
    (dict(world_size=4, tp=2), "tp=2 on an MoE model"),
])
def test_cpu_backend_refuses_unverified_fsdp_expert_combinations(kw: dict, why: str) -> None:
    layout = Layout(gbs=4, precision="fp32", fsdp="optim", **kw)
    reason = unsupported_reason(preset("tiny-moe"), layout, cuda=False, te=False)
    assert reason is not None and why in reason


def test_gpu_backend_refuses_fsdp_until_it_has_run_there() -> None:
    layout = Layout(world_size=2, gbs=4, fsdp="optim")
    reason = unsupported_reason(preset("tiny-gpt"), layout, cuda=True, te=True)
    assert reason is not None and "megatron-core-gpu" in reason and "CPU backend only" in reason
