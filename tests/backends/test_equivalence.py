"""The layout equivalence gate: a reference made on one rank, loaded (resharded) into other layouts.

e2e cases run real megatron-core ranks on gloo (tests/backends/megatron_ranks.py, no Ray): one FP32 reference per model
(tiny-gpt, tiny-moe) on a single rank, then TP/PP/DP/VPP/CP/SP and EP layouts load it and must reproduce its loss
and gradient norm within the FP32 tolerance (1e-3; measured errors are printed, run with -s); a layout whose TP
shards are deliberately misplaced must fail as ``equivalence``. Unit tests cover the plan (what a layout can take),
the reference file and the tolerance table.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from sweeper.backends.base import RankReport, SmokeRequest
from sweeper.backends.megatron.equivalence import (
    FORMAT,
    REFERENCE_FILE,
    TOLERANCE,
    ReferenceError,
    gate_sequences,
    plan,
    read_reference,
    reference_vocab_size,
    rel_err,
    tolerance,
)
from sweeper.config.run_settings import RunSettings
from sweeper.models.catalog import preset
from sweeper.space.layout import Layout

SEQ = 32
REF_SEQUENCES = 4  # the reference batch: a multiple of every DP size below (and >= PP for VPP)


def _request(trial_dir: Path, layout: Layout, model: str, **kw: object) -> SmokeRequest:
    sys.path.insert(0, str(Path(__file__).parent))  # the rank-spawning helper lives next to this file
    from megatron_ranks import smoke_request

    return smoke_request(trial_dir, layout, model, SEQ, **kw)


def _run(request: SmokeRequest, world: int) -> list[RankReport]:
    sys.path.insert(0, str(Path(__file__).parent))  # the rank-spawning helper lives next to this file
    from megatron_ranks import run_ranks

    reports = run_ranks(request, world, timeout_s=180.0)
    assert all(r is not None for r in reports), f"a rank died or hung: {reports}"
    return reports  # type: ignore[return-value]


def _make_reference(root: Path, model: str) -> Path:
    directory = root / "reference"
    layout = Layout(world_size=1, gbs=REF_SEQUENCES, precision="fp32")
    [report] = _run(_request(root / "ref_trial", layout, model, reference_checkpoint=str(directory),
                             make_reference=True, steps=0), 1)
    assert report.ok, f"[{report.failure_kind}] {report.error}"
    assert report.equivalence is not None and report.checks.equivalence_rel_err is None
    return directory


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_reference(tmp_path_factory.mktemp("gpt"), "tiny-gpt")


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_reference(tmp_path_factory.mktemp("moe"), "tiny-moe")


def _check(tmp_path: Path, reference: Path, layout: Layout, model: str, **kw: object) -> list[RankReport]:
    return _run(_request(tmp_path / "trial", layout, model, reference_checkpoint=str(reference), **kw),
                layout.world_size)


def _assert_equivalent(reports: list[RankReport], reference: Path, limit: float, what: str) -> float:
    ref = json.loads((reference / REFERENCE_FILE).read_text())
    for r in reports:
        assert r.ok, f"rank {r.rank}: [{r.failure_kind}] {r.error}"
        assert r.checks.finite and r.losses, "the training steps run after the gate"
    # Global loss and norm: every rank reports the same pair, hence the same error.
    assert all(r.equivalence == reports[0].equivalence for r in reports)
    err = reports[0].checks.equivalence_rel_err
    assert all(r.checks.equivalence_rel_err == err for r in reports)
    got = reports[0].equivalence
    assert err == max(rel_err(got["loss"], ref["loss"]), rel_err(got["grad_norm"], ref["grad_norm"]))
    print(f"\n[equivalence] {what}: loss {got['loss']:.7f} (ref {ref['loss']:.7f}), grad_norm "
          f"{got['grad_norm']:.7f} (ref {ref['grad_norm']:.7f}), rel_err {err:.3g}")
    assert err <= limit
    return err


# --------------------------------------------------------------------------------------------------------------
# e2e: real megatron-core ranks on gloo


@pytest.mark.e2e
def test_reference_records_a_fitted_batch(gpt_reference: Path) -> None:
    ref = json.loads((gpt_reference / REFERENCE_FILE).read_text())
    assert (gpt_reference / "metadata.json").exists()  # the torch_dist checkpoint itself
    assert ref["sequences"] == REF_SEQUENCES and ref["seq_length"] == SEQ and ref["precision"] == "fp32"
    assert ref["vocab_size"] == 1024  # 256 padded to a multiple of 128 x 8, loadable by TP 1, 2, 4, 8
    # Unit-gain weights start near chance on random tokens; the fit brings the batch's loss far below it.
    assert ref["loss_before_fit"] > math.log(256)
    assert ref["loss"] < ref["loss_before_fit"] / 2
    assert 0.1 < ref["grad_norm"] < 100


DENSE_LAYOUTS = {
    "tp2": Layout(world_size=2, tp=2, gbs=4, precision="fp32"),
    "pp2": Layout(world_size=2, pp=2, gbs=4, precision="fp32"),
    "dp2-distopt": Layout(world_size=2, gbs=4, precision="fp32", distributed_optimizer=True),
    "tp2xpp2": Layout(world_size=4, tp=2, pp=2, gbs=4, precision="fp32"),
    "pp2-vpp2": Layout(world_size=2, pp=2, vpp=2, gbs=4, precision="fp32"),
    "cp2": Layout(world_size=2, cp=2, gbs=4, precision="fp32"),
    "tp2-sp": Layout(world_size=2, tp=2, sp=True, gbs=4, precision="fp32"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(DENSE_LAYOUTS))
def test_dense_layouts_reproduce_the_reference(tmp_path: Path, gpt_reference: Path, name: str) -> None:
    layout = DENSE_LAYOUTS[name]
    _assert_equivalent(_check(tmp_path, gpt_reference, layout, "tiny-gpt"), gpt_reference, TOLERANCE["fp32"],
                       f"tiny-gpt {name}")


MOE_LAYOUTS = {
    "ep2": Layout(world_size=2, ep=2, gbs=4, precision="fp32"),
    "pp2xep2": Layout(world_size=4, pp=2, ep=2, gbs=4, precision="fp32"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_layouts_reproduce_the_reference(tmp_path: Path, moe_reference: Path, name: str) -> None:
    layout = MOE_LAYOUTS[name]
    _assert_equivalent(_check(tmp_path, moe_reference, layout, "tiny-moe"), moe_reference, TOLERANCE["fp32"],
                       f"tiny-moe {name}")


@pytest.mark.e2e
def test_overlapped_dp_reduce_and_gather_train_as_the_synchronous_run(tmp_path: Path, gpt_reference: Path) -> None:
    """Issue 30: overlap_grad_reduce and overlap_param_gather (Bridge's defaults) at DP 2 on gloo's async
    collectives. The steps run four micro-batches, the gate two: without ``no_sync_func`` Megatron starts each
    bucket's reduce-scatter once as many micro-batches as in the first batch (the gate's) are done, and the
    steps silently train on a half-reduced gradient. With it the losses are those of Megatron-LM's defaults
    (no overlap), the gate matches the reference, and after three steps the replicas agree and the checkpoint
    reloads bit-identical (the all-gather the last step deferred is forced first)."""
    layout = Layout(world_size=2, gbs=8, mbs=1, precision="fp32", distributed_optimizer=True)
    assert layout.num_microbatches == 4
    runs = {}
    for framework in ("megatron-bridge", "megatron-lm"):
        reports = _check(tmp_path / framework, gpt_reference, layout, "tiny-gpt",
                         run=RunSettings(framework=framework), steps=3, checkpoint=True)
        _assert_equivalent(reports, gpt_reference, TOLERANCE["fp32"], f"tiny-gpt dp2 distopt {framework}")
        for r in reports:
            assert r.checks.replicas_consistent and r.checks.checkpoint_reloaded, (r.failure_kind, r.error)
            # The steps' peak and the checkpoint phase's, apart; nothing outside an allocator on the CPU.
            assert r.peak_memory_bytes > 0 and r.checkpoint_peak_memory_bytes > 0 and r.non_torch_memory_bytes is None
        runs[framework] = reports[0]
    overlapped, synchronous = runs["megatron-bridge"], runs["megatron-lm"]
    assert len(overlapped.losses) == 3
    assert overlapped.losses == pytest.approx(synchronous.losses, rel=1e-6, abs=0)
    assert overlapped.grad_norms == pytest.approx(synchronous.grad_norms, rel=1e-6, abs=0)


@pytest.mark.e2e
def test_bf16_layout_within_the_bf16_tolerance(tmp_path: Path, gpt_reference: Path) -> None:
    layout = Layout(world_size=2, tp=2, gbs=4, precision="bf16")
    err = _assert_equivalent(_check(tmp_path, gpt_reference, layout, "tiny-gpt"), gpt_reference,
                             tolerance("bf16", "fp32"), "tiny-gpt tp2 bf16 vs fp32 reference")
    assert err > 0  # BF16 weights and GEMMs do differ from the FP32 reference; the tolerance absorbs it


@pytest.mark.e2e
def test_misplaced_tp_shards_fail_as_equivalence(tmp_path: Path, gpt_reference: Path) -> None:
    layout = Layout(world_size=2, tp=2, gbs=4, precision="fp32")
    reports = _check(tmp_path, gpt_reference, layout, "tiny-gpt", inject="swap_shards")
    for r in reports:
        assert not r.ok and r.failure_kind == "equivalence", f"rank {r.rank}: [{r.failure_kind}] {r.error}"
        assert r.error and "\n" not in r.error and "relative error" in r.error
        assert r.checks.equivalence_rel_err > 100 * TOLERANCE["fp32"]
        assert not r.losses, "the trial stops at the gate, before its training steps"
        # What the rank proved before the gate failed it: its groups, its model, a forward and backward.
        assert r.checks.process_group and r.checks.model_built and r.checks.forward_backward, r.checks
    print(f"\n[equivalence] tiny-gpt tp2 with swapped fc1 shards: rel_err {reports[0].checks.equivalence_rel_err:.3g}")


@pytest.mark.e2e
def test_a_trial_compares_on_the_shortest_prefix_its_replicas_split(tmp_path: Path) -> None:
    """A 16-sequence reference (a proxy sweep's, whose widest trials run 16 replicas) measures its prefixes of 4 and
    8 sequences; a TP2 trial compares on 4 of them (a quarter of the gate's forward/backwards), within FP32's
    tolerance, and a scrambled shard still fails there by orders of magnitude."""
    directory = tmp_path / "reference"
    layout = Layout(world_size=1, gbs=16, precision="fp32")
    [made] = _run(_request(tmp_path / "ref_trial", layout, "tiny-gpt", reference_checkpoint=str(directory),
                           make_reference=True, steps=0), 1)
    assert made.ok, f"[{made.failure_kind}] {made.error}"
    ref = json.loads((directory / REFERENCE_FILE).read_text())
    assert sorted(ref["prefixes"]) == ["4", "8"] and ref["sequences"] == 16
    assert len({ref["loss"], *(loss for loss, _ in ref["prefixes"].values())}) == 3  # three different batches
    tp2 = Layout(world_size=2, tp=2, gbs=4, precision="fp32")
    reports = _check(tmp_path / "tp2", directory, tp2, "tiny-gpt")
    assert all(r.ok for r in reports), [(r.failure_kind, r.error) for r in reports]
    got = reports[0].equivalence
    assert got is not None and got["sequences"] == 4
    loss, norm = ref["prefixes"]["4"]
    assert reports[0].checks.equivalence_rel_err == max(rel_err(got["loss"], loss), rel_err(got["grad_norm"], norm))
    assert reports[0].checks.equivalence_rel_err <= TOLERANCE["fp32"]
    scrambled = _check(tmp_path / "swapped", directory, tp2, "tiny-gpt", inject="swap_shards")
    assert all(r.failure_kind == "equivalence" for r in scrambled)
    assert scrambled[0].checks.equivalence_rel_err > 100 * TOLERANCE["fp32"]
    print(f"\n[equivalence] 4 of 16 sequences: tp2 rel_err {reports[0].checks.equivalence_rel_err:.3g}, swapped "
          f"shards {scrambled[0].checks.equivalence_rel_err:.3g}")


@pytest.mark.e2e
def test_missing_reference_is_infra_not_the_layout(tmp_path: Path) -> None:
    layout = Layout(world_size=1, gbs=4, precision="fp32")
    [report] = _check(tmp_path, tmp_path / "nowhere", layout, "tiny-gpt")
    assert not report.ok and report.failure_kind == "infra"
    assert "reference.json" in report.error and "does not exist" in report.error


# --------------------------------------------------------------------------------------------------------------
# unit: plan, reference file, tolerances


def _write_reference(directory: Path, model: str = "tiny-gpt", **over: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    data = dict(format=FORMAT, model=preset(model).model_dump(), layout={}, precision="fp32", seed=1, sequences=4,
                seq_length=32, vocab_size=1024, loss=1.5, grad_norm=2.0, loss_before_fit=7.3, prefixes={})
    data.update(over)
    (directory / REFERENCE_FILE).write_text(json.dumps(data))


def _plan(tmp_path: Path, layout: Layout, model: str = "tiny-gpt", **kw: object):  # type: ignore[no-untyped-def]
    kw.setdefault("reference_checkpoint", str(tmp_path / "ref"))
    request = _request(tmp_path / "t", layout, model, **kw)
    return plan(request)


def test_a_trial_gates_on_the_shortest_measured_prefix_its_replicas_split(tmp_path: Path) -> None:
    _write_reference(tmp_path / "ref", sequences=16, prefixes={"4": [1.0, 2.0], "8": [1.2, 2.2]})
    ref = read_reference(tmp_path / "ref")
    cases = {Layout(world_size=1, gbs=4): 4, Layout(world_size=2, gbs=4): 4, Layout(world_size=8, gbs=8): 8,
             Layout(world_size=16, gbs=16): 16, Layout(world_size=4, pp=2, gbs=8): 4,
             # The interleaved schedule needs PP micro-batches per rank: 2 replicas x 4.
             Layout(world_size=8, pp=4, vpp=2, gbs=8): 8}
    assert {lo.short(): gate_sequences(ref, lo) for lo in cases} == {lo.short(): k for lo, k in cases.items()}
    assert ref.on(8) == (1.2, 2.2) and ref.on(16) == (1.5, 2.0)


def test_plan_check_builds_with_the_reference_vocabulary(tmp_path: Path) -> None:
    _write_reference(tmp_path / "ref")
    gate = _plan(tmp_path, Layout(world_size=4, tp=4, gbs=4))
    assert gate.mode == "check" and gate.vocab_size == 1024 and gate.skip_reason is None


@pytest.mark.parametrize(
    ("layout", "over", "reason"),
    [
        (Layout(world_size=8, gbs=8), {}, "does not split over dp=8"),
        (Layout(world_size=4, tp=4, gbs=4), {"vocab_size": 1026}, "not divisible by tp=4"),
        (Layout(world_size=4, pp=4, vpp=2, gbs=4), {"sequences": 2}, "at least pp=4 micro-batches"),
    ],
)
def test_plan_skips_layouts_that_cannot_take_the_reference_batch(
    tmp_path: Path, layout: Layout, over: dict, reason: str
) -> None:
    _write_reference(tmp_path / "ref", **over)
    gate = _plan(tmp_path, layout)
    assert gate.vocab_size is None and reason in gate.skip_reason


def test_plan_rejects_another_models_reference(tmp_path: Path) -> None:
    _write_reference(tmp_path / "ref", model="tiny-moe")
    with pytest.raises(ReferenceError, match="made for model 'tiny-moe'"):
        _plan(tmp_path, Layout(world_size=1, gbs=4))


def test_plan_make_needs_a_directory_and_a_splittable_batch(tmp_path: Path) -> None:
    layout = Layout(world_size=1, gbs=4)
    with pytest.raises(ReferenceError, match="needs reference_checkpoint"):
        plan(_request(tmp_path, layout, "tiny-gpt", make_reference=True))
    gate = _plan(tmp_path, Layout(world_size=2, tp=2, gbs=4), make_reference=True)
    assert gate.mode == "make" and gate.vocab_size == 1024
    assert _plan(tmp_path, Layout(world_size=1, gbs=4), reference_checkpoint=None) is None


def test_reference_vocabulary_is_tp_independent() -> None:
    assert reference_vocab_size(256, 1) == 1024
    assert reference_vocab_size(50257, 1) == 51200 and all(51200 % tp == 0 for tp in (1, 2, 4, 8, 16))
    assert reference_vocab_size(102400, 1) == 102400
    assert reference_vocab_size(1000, 16) % (128 * 16) == 0


def test_tolerances() -> None:
    assert TOLERANCE["fp32"] == 1e-3  # the project's CPU/FP32 requirement
    assert TOLERANCE["fp32"] < TOLERANCE["fp16"] < TOLERANCE["bf16"] < TOLERANCE["fp8"] == TOLERANCE["mxfp8"]
    assert tolerance("fp32", "bf16") == tolerance("bf16", "fp32") == TOLERANCE["bf16"]
    assert rel_err(1.0005, 1.0) == pytest.approx(5e-4) and rel_err(math.nan, 1.0) == math.inf


def test_only_delayed_fp8_scaling_warms_its_amax_history_before_the_gate() -> None:
    """Issue 44: delayed scaling's first FP8 iteration runs at scale 1 (an empty amax history); the gate discards
    one forward/backward first. Current, blockwise and MXFP8 scaling need none, nor does a run without FP8. (The
    discarded iteration itself runs on a GPU only: scripts/gpu_check.sh's FP8 cases.)"""
    from types import SimpleNamespace

    from sweeper.backends.megatron.equivalence import scales_from_history

    assert scales_from_history(SimpleNamespace(fp8="hybrid", fp8_recipe="delayed"))
    for fp8, recipe in (("hybrid", "tensorwise"), ("e4m3", "blockwise"), ("e4m3", "mxfp8"), (None, "delayed")):
        assert not scales_from_history(SimpleNamespace(fp8=fp8, fp8_recipe=recipe))
