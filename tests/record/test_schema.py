"""sweeper.record: the typed trials.jsonl / sweep.json records, their tolerant reading, and the JSON Schemas in
docs/schemas/ (generated from the types: a change to a type without regenerating them fails here)."""

from __future__ import annotations

import json
from pathlib import Path

from sweeper.record.schema import SweepMeta, TrialMetrics, TrialRecord, TrialResult, json_schemas
from sweeper.record.sweepdir import SweepDir, read_meta, read_trials

ROOT = Path(__file__).resolve().parents[2]


def test_docs_schemas_are_the_generated_ones() -> None:
    for name, schema in json_schemas().items():
        path = ROOT / "docs" / "schemas" / name
        assert path.is_file(), f"{path} missing: run python -m sweeper.record.schema"
        assert json.loads(path.read_text()) == schema, f"{name} is stale: run python -m sweeper.record.schema"


def test_a_record_round_trips_through_its_json_line(tmp_path: Path) -> None:
    result = TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=1234.5, peak_memory_gib=3.0))
    record = TrialRecord(number=3, layout={"tp": 2, "gpus": 4}, result=result, attempt=2, phase="confirm",
                         predicted={"memory_gib": 2.5}, started_at="a", ended_at="b", mlflow_run_id="r",
                         neighbours=["1.1", "2.1"], other_jobs_gpus=4)
    sweep = SweepDir(tmp_path)
    sweep.append_trial(record)
    assert sweep.read_trials() == [record]
    assert record.predicted_memory_gib == 2.5 and not record.alone
    assert set(json.loads(sweep.trials.read_text())) == {"number", "layout", "result", "predicted", "started_at",
                                                         "ended_at", "attempt", "mlflow_run_id", "phase",
                                                         "neighbours", "other_jobs_gpus"}


def test_reading_skips_torn_and_foreign_lines_and_drops_unknown_result_keys(tmp_path: Path) -> None:
    good = TrialRecord(number=1, layout={}, result=TrialResult(status="pruned")).to_json()
    newer = json.loads(json.dumps(good))
    newer["result"]["metrics"]["a_future_metric"] = 1.0
    newer["result"]["a_future_key"] = "x"
    path = tmp_path / "trials.jsonl"
    path.write_text("\n".join([json.dumps(good), json.dumps(newer), "[1, 2]", '{"number": 2}', '{"numb']) + "\n")
    records, skipped = read_trials(path)
    assert [r.number for r in records] == [1, 1] and skipped == 3
    assert records[1].result.status == "pruned"


def test_sweep_meta_keeps_unknown_keys_and_reads_wrong_types_as_unknown(tmp_path: Path) -> None:
    meta = SweepMeta.from_json({"name": "s", "memory_headroom": True, "cluster": "8 GPUs", "model": "tiny-gpt",
                                "written_by_a_newer_version": {"k": 1}})
    assert meta.memory_headroom is None and meta.cluster is None and meta.model == {"name": "tiny-gpt"}
    sweep = SweepDir(tmp_path)
    meta.status = "finished"
    sweep.write_meta(meta)
    back = json.loads(sweep.meta.read_text())
    assert back["written_by_a_newer_version"] == {"k": 1} and back["status"] == "finished"
    assert "best" not in back  # never set, so not written
    assert SweepDir(tmp_path / "none").read_meta() == SweepMeta()


def test_sweep_json_lists_one_layout_per_line_and_reads_back_whole(tmp_path: Path) -> None:
    """sweep.json's per-layout lists are written one compact entry per line (issue 46: json's indented encoder took
    0.5 s per rewrite of a 1,024-GPU space's 16,576 pruned layouts); the file is the same JSON."""
    sweep = SweepDir(tmp_path)
    pruned = [{"layout": f"TP{tp}-PP2", "memory_gib": 90.0 + tp, "reason": 'needs "more", \\ than 80 GiB'}
              for tp in (1, 2, 4)]
    meta = SweepMeta(name="s", memory_pruned=pruned, dominated=[], unsupported=None)
    sweep.write_meta(meta)
    text = sweep.meta.read_text()
    assert json.loads(text) == meta.to_json()
    assert sweep.read_meta().memory_pruned == pruned
    lines = text.splitlines()
    assert [json.loads(line.strip().rstrip(",")) for line in lines if line.lstrip().startswith('{"layout"')] == pruned


def test_sweep_json_rewritten_with_some_entries_new_says_what_a_first_write_says(tmp_path: Path) -> None:
    """Issue 54: the lines of entries written before are kept, not encoded again; a new entry (a new dict) is
    written as itself, and the file is what one write of the same lists says."""
    sweep = SweepDir(tmp_path / "kept")
    pruned = [{"layout": f"TP{tp}-PP2", "memory_gib": 90.0 + tp, "reason": "over"} for tp in (1, 2, 4)]
    sweep.write_meta(SweepMeta(name="s", memory_pruned=pruned, dominated=[{"layout": "a", "reason": "b"}]))
    again = [pruned[0], {**pruned[1], "memory_gib": 70.0}, pruned[2], {"layout": "TP8-PP2", "memory_gib": 1.0}]
    meta = SweepMeta(name="s", memory_pruned=again, dominated=[])
    sweep.write_meta(meta)
    fresh = SweepDir(tmp_path / "fresh")
    fresh.write_meta(meta)
    assert sweep.meta.read_text() == fresh.meta.read_text()
    assert json.loads(sweep.meta.read_text())["memory_pruned"][1]["memory_gib"] == 70.0


def test_sweep_json_with_a_nan_reads_back_and_a_broken_one_reads_as_none(tmp_path: Path) -> None:
    """sweep.json is parsed by orjson, which refuses the NaN and Infinity that json.dumps writes for a float that is
    one: such a file is read through json instead, and one that is not JSON (or not UTF-8) reads as none."""
    sweep = SweepDir(tmp_path / "nan")
    pruned = [{"layout": "TP1-PP2", "memory_gib": float("nan"), "reason": "over"}]
    sweep.write_meta(SweepMeta(name="s", memory_pruned=pruned, scheduling_efficiency=float("inf")))
    assert "NaN" in sweep.meta.read_text()
    back = SweepDir(tmp_path / "nan").read_meta()
    assert back.name == "s" and back.scheduling_efficiency == float("inf")
    assert back.memory_pruned is not None and back.memory_pruned[0]["memory_gib"] != back.memory_pruned[0]["memory_gib"]
    for text in (b'{"name": "s", ', b'\xff\xfe{"name": "s"}'):
        broken = SweepDir(tmp_path / str(len(text)))
        broken.meta.parent.mkdir(parents=True, exist_ok=True)
        broken.meta.write_bytes(text)
        assert read_meta(broken.meta) is None
