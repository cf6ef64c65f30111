"""Pipeline layout strings in the space (issue 52): the balanced layout sweeper generates where the layers do not
divide by PP x VPP, the rules' reading of a string (MTP included), the accounted split with a virtual stage that
holds only the embedding or the loss, and the enumeration of ``space.pipeline_layout``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sweeper.config.schema import ClusterConfig, SpaceConfig, SweepConfig, TrainingConfig
from sweeper.estimate import estimate
from sweeper.models.catalog import preset
from sweeper.models.spec import ModelSpec
from sweeper.plan import rules
from sweeper.plan.space import enumerate_layouts, pipeline_layout_values
from sweeper.space.layout import Layout, PipelineSplit
from sweeper.space.pipeline import accounted_split, balanced_layout, check_layout, stage_layers
from tests.space.cpu_trial import ENV, assert_trial_passes, write_space

ROOT = Path(__file__).resolve().parents[2]
H100x8 = ClusterConfig(nodes=128, gpus_per_node=8, gpu_memory_gib=80, compute_capability="9.0")


@pytest.mark.parametrize(("layers", "pp", "vpp", "mtp", "expected"), [
    (61, 8, 4, 1, "Et|(tt|)*30mL"),  # DeepSeek-V3 on NVIDIA's interleaved 1,024-GPU recipe
    (61, 8, 4, 0, "E|(tt|)*30tL"),
    (30, 4, 8, 0, "E|(t|)*30L"),  # what the embedding and the loss accounted as layers build
    (126, 8, 8, 0, "Et|(tt|)*62tL"),
    (27, 4, 1, 0, "Et*6|(t*7|)*2t*7L"),
    (61, 8, 1, 1, "Et*7|(t*8|)*6t*6mL"),
    (61, 16, 4, 1, None),  # 64 stages for 61 layers: a middle stage would hold no decoder layer
])
def test_balanced_layout(layers: int, pp: int, vpp: int, mtp: int, expected: str | None) -> None:
    assert balanced_layout(layers, pp, vpp, mtp) == expected


@settings(max_examples=300, deadline=None)
@given(layers=st.integers(1, 130), pp=st.integers(2, 16), vpp=st.integers(1, 8), mtp=st.integers(0, 2))
def test_a_balanced_layout_is_valid_and_even(layers: int, pp: int, vpp: int, mtp: int) -> None:
    text = balanced_layout(layers, pp, vpp, mtp)
    if text is None:
        return
    stages = check_layout(text, pp, layers, mtp)
    assert len(stages) == pp * vpp
    loads = [len(stage) for stage in stages]  # E, L, m and t each weigh one layer
    # Even to one layer, but for a last stage whose loss and MTP alone outweigh the others' load.
    even = loads if loads[-1] > 1 + mtp else loads[:-1]
    assert max(even) - min(even) <= 1, (text, loads)
    assert all("t" in stage for stage in stages[1:-1])


@pytest.mark.parametrize(("text", "pp", "layers", "mtp", "reason"), [
    ("Et|(tt|)*30mL", 8, 61, 0, "Number of mtp layers in layout (1) must match mtp_num_layers (0)"),
    ("Et|(tt|)*30L", 8, 61, 1, "Number of mtp layers in layout (0) must match mtp_num_layers (1)"),
    ("Et|(tt|)*29tm|tL", 8, 61, 1, "decoder layers must be placed before MTP layers"),
    ("Ettt|ttm||L", 2, 5, 1, "MTP must be in the last virtual pipeline stage of its pipeline rank"),
    ("Ettt|tt|m|mL", 2, 5, 2, "all of the MTP layers must be in the same one virtual pipeline stage"),
])
def test_check_layout_reads_mtp_as_megatron_does(text: str, pp: int, layers: int, mtp: int, reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        check_layout(text, pp, layers, mtp)


def test_mtp_on_the_last_stage_of_another_rank_is_megatrons_standalone_mtp() -> None:
    # validate_layer_layout accepts m in the last virtual stage of a rank other than the last (mtp_standalone):
    # stage 30 of 32 on PP8 is rank 6's last.
    assert check_layout("Et|(tt|)*29ttm|L", 8, 61, 1)[-2] == "ttm"


def test_30_layers_on_pp4_vpp8_with_the_embedding_and_loss_accounted_is_valid() -> None:
    # megatron-core 0.16.1 builds it: 32 slots, one per virtual stage, rank 0's first holding only the embedding.
    model = ModelSpec(num_layers=30, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=128)
    assert accounted_split(30, 4, 8) == (True, True)
    layout = Layout(world_size=4, pp=4, vpp=8, gbs=8, account_for_embedding=True, account_for_loss=True)
    assert rules.check(model, layout, H100x8, 64) == []
    chunks = stage_layers(30, 4, 8, split=layout.split)
    assert chunks[0][0] == () and chunks[3][7] == () and chunks[1][0] == (0,)
    assert stage_layers(30, 4, 8, split=PipelineSplit(layout="E|(t|)*30L")) == chunks


def _deepseek(**space: object) -> SweepConfig:
    return SweepConfig(name="ds3", model=preset("deepseek-v3"), cluster=H100x8,
                       training=TrainingConfig(seq_length=4096, global_batch_size=8192),
                       space=SpaceConfig(gpus=[1024], tp=[2], ep=[64], precision=["bf16"], **space))


def test_auto_generates_the_balanced_layout_besides_sweepers_split() -> None:
    cfg = _deepseek(pp=[8], vpp=[1, 4])
    layouts = enumerate_layouts(cfg)
    by_pipeline = sorted(((lo.vpp, lo.first_stage_layers, lo.pipeline_layout) for lo in layouts), key=str)
    generated = balanced_layout(61, 8, 4, cfg.model.mtp_num_layers)
    # On PP8 alone the balanced string places the layers as the uneven 7/6 split does (MTP on the last stage either
    # way): one layout, not two.
    assert balanced_layout(61, 8, 1, 1) == "Et*7|(t*8|)*6t*6mL"
    assert by_pipeline == sorted([(1, 7, None), (4, None, None), (4, None, generated)], key=str)
    interleaved = next(lo for lo in layouts if lo.pipeline_layout == generated)
    assert rules.check(cfg.model, interleaved, cfg.cluster, cfg.training.seq_length) == []
    assert f"--pipeline-model-parallel-layout={generated}" in interleaved.megatron_args()
    assert not any(a.startswith("--num-virtual-stages-per-pipeline-rank") for a in interleaved.megatron_args())
    # The PP8 x VPP4 layout without a string still has no split that fits: the plan says why.
    plain = next(lo for lo in layouts if lo.vpp == 4 and lo.pipeline_layout is None)
    assert "neither an uneven first/last-stage split" in " ".join(
        rules.check(cfg.model, plain, cfg.cluster, cfg.training.seq_length))
    assert pipeline_layout_values(cfg) == [None, generated]


def test_a_layout_string_in_the_space_sets_its_own_virtual_stages() -> None:
    text = balanced_layout(61, 8, 4, preset("deepseek-v3").mtp_num_layers)
    assert text is not None
    layouts = enumerate_layouts(_deepseek(pp=[8, 16, 3], vpp=[1, 2], pipeline_layout=[text]))
    # 32 stages: PP8 x VPP4 and PP16 x VPP2; PP3 does not divide them, so the string names no layout there.
    assert sorted((lo.pp, lo.vpp) for lo in layouts) == [(8, 4), (16, 2)]
    assert {lo.pipeline_layout for lo in layouts} == {text}


def test_auto_is_a_layout_without_a_string() -> None:
    assert Layout(world_size=8, pp=2, pipeline_layout="auto") == Layout(world_size=8, pp=2)


@pytest.mark.e2e
def test_a_generated_layout_trains_on_the_cpu_backend(tmp_path: Path) -> None:
    """5 layers on PP2 x VPP2 split neither evenly, nor unevenly (counts must divide by VPP), nor with the
    embedding and loss accounted: only sweeper's generated layout string places them. A real 2-rank megatron-core
    trial builds it (TransformerConfig's pipeline_model_parallel_layout, VPP from the string), passes the
    equivalence gate against the one-rank reference and reloads its checkpoint."""
    text = balanced_layout(5, 2, 2)
    assert text == "E|(tt|)*2tL"
    path = write_space(tmp_path, "generated-layout", 5, 2, {"pp": [2], "vpp": [2]})
    planned = json.loads(subprocess.run(
        [sys.executable, "-m", "sweeper", "plan", str(path), "--json"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env=ENV, check=True).stdout)
    assert [(e["layout"]["vpp"], e["layout"].get("pipeline_layout")) for e in planned if e["valid"]] == [(2, text)]
    assert_trial_passes(tmp_path, path, f"gpus=2,pp=2,pipeline_layout={text}")


def test_the_estimator_prices_the_stages_a_layout_string_places() -> None:
    # The same placement written two ways is priced the same; moving layers onto the last rank (which also holds
    # the output layer and the loss) makes it the hot stage: more memory and a slower step.
    llama = preset("llama3.1-405b")
    base = dict(world_size=1024, tp=8, pp=8, vpp=8, cp=2, mbs=1, gbs=512)
    accounted = estimate(llama, Layout(**base, account_for_embedding=True, account_for_loss=True), H100x8, 8192)
    written = estimate(llama, Layout(**base, pipeline_layout="Et|(tt|)*62tL"), H100x8, 8192)
    assert (written.memory_gib, written.step_time_s) == (accounted.memory_gib, accounted.step_time_s)
    heavy_last = "E|(tt|)*56" + "t|" * 6 + "t*8L"  # rank 7: 22 layers, the others 14 to 16
    assert check_layout(heavy_last, 8, 126)
    hot = estimate(llama, Layout(**base, pipeline_layout=heavy_last), H100x8, 8192)
    assert hot.memory_gib > written.memory_gib and hot.step_time_s > written.step_time_s


def test_optuna_can_name_every_layout_of_the_space(tmp_path: Path) -> None:
    # The study's categorical for pipeline_layout holds the generated strings: each layout's params map back to it.
    from sweeper.search.propose.study import LayoutStudy

    cfg = _deepseek(pp=[8, 16], vpp=[1, 2, 4])
    layouts = enumerate_layouts(cfg)
    study = LayoutStudy(cfg, tmp_path / "journal.log", "tpe", 0, layouts)
    for layout in layouts:
        assert study.layout_of(study.params_of(layout)) == layout
    assert all(-1 not in study._coordinates(lo) for lo in layouts)  # every value is one of the choices


def test_the_vendor_space_holds_the_interleaved_deepseek_v3_layout() -> None:
    from sweeper.config.load import load_config
    from sweeper.plan.assess import build_plan

    cfg = load_config(ROOT / "search_spaces" / "deepseek_v3_1024_vendor.yaml")
    entries = build_plan(cfg, {"pp": 8, "vpp": 4, "precision": "bf16", "recompute": "full",
                               "moe_token_dispatcher": "alltoall"})
    by_string = {e.layout.pipeline_layout: e for e in entries}
    assert set(by_string) == {None, "Et|(tt|)*30mL"}  # auto's generated string and the written one are the same
    assert by_string["Et|(tt|)*30mL"].valid and by_string["Et|(tt|)*30mL"].launchable
    assert "neither an uneven first/last-stage split" in " ".join(by_string[None].reasons)


def test_only_pipeline_layout_auto_keeps_the_layouts_without_a_string() -> None:
    from sweeper.plan.space import matches, only_filter

    with_string = Layout(world_size=8, pp=2, vpp=2, pipeline_layout="E|(tt|)*2tL")
    assert matches(Layout(world_size=8, pp=2), only_filter("pipeline_layout=auto"))
    assert not matches(with_string, only_filter("pipeline_layout=auto"))
    assert matches(with_string, only_filter("pipeline_layout=E|(tt|)*2tL"))
