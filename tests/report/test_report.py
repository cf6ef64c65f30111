"""Tests of the HTML sweep report rendered from a sweep directory's recorded files.

The fixture below writes a small, hand-made sweep directory (TEST FIXTURE — not a real sweep): explore trials that
passed, one over the memory headroom, failures of several kinds, pruned layouts, an infra failure retried, and
confirmation runs of the winner, in the trials.jsonl / sweep.json shapes of docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sweeper.record.schema import TrialChecks, TrialMetrics, TrialResult
from sweeper.report.render import REPORT_FILE, load_trials, pareto_front, render_report, report_figures
from sweeper.space.layout import Layout

GPU_MEMORY_GIB = 80.0
HEADROOM = 0.10  # limit = 72.0 GiB
EVIL_ERROR = "RuntimeError: <script>alert('pwned')</script> & more"


def _layout(gpus: int = 8, **kw: Any) -> Layout:
    return Layout(world_size=gpus, gbs=64, **kw)


def _passed(tokens: float, peak: float, tflops: float = 100.0) -> TrialResult:
    checks = TrialChecks(process_group=True, model_built=True, forward_backward=True, finite=True,
                         checkpoint_saved=True, checkpoint_reloaded=True, equivalence_rel_err=1e-4)
    return TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=tokens, step_time_s=1.0,
                       tflops_per_gpu=tflops, peak_memory_gib=peak, loss_first=10.5, loss_last=9.8),
                       checks=checks, backend="megatron-core-gpu", memory_kind="device",
                       checkpoint_bytes=3 * 2**29, checkpoint_deleted=True)


def _failed(kind: str, error: str, peak: float | None = None) -> TrialResult:
    return TrialResult(status="failed", failure_kind=kind, error=error,  # type: ignore[arg-type]
                       metrics=TrialMetrics(peak_memory_gib=peak), backend="megatron-core-gpu", memory_kind="device")


def _line(number: int, layout: Layout, result: TrialResult, predicted: float | None, attempt: int = 1,
          phase: str = "explore") -> dict[str, Any]:
    launched = result.status != "pruned"
    return {
        "number": number,
        "layout": layout.to_dict(),
        "result": result.to_json(),
        "predicted": None if predicted is None else
        {"memory_gib": predicted, "fits": predicted <= 72.0, "step_time_s": 1.0, "tokens_per_s": 1000.0},
        "started_at": f"2025-01-01T00:{number:02d}:00+00:00" if launched else None,
        "ended_at": f"2025-01-01T00:{number:02d}:42+00:00" if launched else None,
        "attempt": attempt,
        "mlflow_run_id": f"run{number:03d}a{attempt}{phase[0]}" if launched else None,
        "phase": phase,
    }


def write_fixture_sweep(directory: Path, *, with_sweep_json: bool = True, torn_tail: bool = False) -> Path:
    """Write a TEST FIXTURE sweep directory (not a real sweep) and return it."""
    best = _layout(tp=2, pp=1, ep=4, sp=True, precision="bf16")
    lines = [
        _line(0, best, _passed(52_000, 60.0, 310.0), 58.0),
        _line(1, _layout(tp=1, ep=8, mbs=2, precision="bf16"), _passed(48_000, 76.5, 290.0), 70.0),  # not stable
        _line(2, _layout(tp=4, pp=2, precision="fp8"), _passed(40_000, 38.0, 250.0), 41.0),
        _line(3, _layout(tp=2, pp=2, recompute="full"), _passed(30_000, 30.0, 200.0), 29.0),
        _line(4, _layout(tp=1, pp=1, mbs=2), _failed("oom", "CUDA out of memory. Tried to allocate 2.0 GiB", 79.9),
              71.0),
        _line(5, _layout(tp=2, pp=4), _failed("nan", EVIL_ERROR), 33.0),
        # infra failure, then a retry of the same trial number that passed
        _line(6, _layout(tp=2, pp=2, ep=2), _failed("infra", "node-1 lost (Ray actor died)"), 45.0, attempt=1),
        _line(6, _layout(tp=2, pp=2, ep=2), _passed(44_000, 47.0, 270.0), 45.0, attempt=2),
        _line(7, _layout(tp=8, pp=1), TrialResult.pruned("tp=8 does not divide num_query_groups=4"), None),
        _line(8, _layout(tp=8, pp=2), TrialResult.pruned("tp=8 does not divide num_query_groups=2"), None),
        _line(9, _layout(tp=1, pp=1, mbs=4), TrialResult.pruned("predicted 95.1 GiB exceeds 72.0 GiB", "oom"), 95.1),
        _line(0, best, _passed(51_000, 60.5, 305.0), 58.0, attempt=1, phase="confirm"),
        _line(0, best, _passed(53_000, 60.2, 315.0), 58.0, attempt=2, phase="confirm"),
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if torn_tail:
        text += json.dumps(_line(10, best, _passed(1.0, 1.0), 1.0))[:57]  # crash mid-write: no closing brace
    (directory / "trials.jsonl").write_text(text, encoding="utf-8")
    if with_sweep_json:
        sweep = {
            "name": "fixture-sweep <test>",
            "model": {"name": "tiny-moe-fixture", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                      "num_moe_experts": 8, "moe_router_topk": 2, "vocab_size": 1024, "ffn_hidden_size": 512},
            "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_memory_gib": GPU_MEMORY_GIB},
            "memory_headroom": HEADROOM,
            "objective": "tokens_per_s",
            "status": "finished",
            "best": {"number": 0, "tokens_per_s": 52_000.0, "peak_memory_gib": 60.5},
            "memory_kind": "device",
            "started_at": "2025-01-01T00:00:00+00:00",
            "ended_at": "2025-01-01T01:00:00+00:00",
            "mlflow": {"tracking_uri": "file:./mlruns", "experiment": "fixture-sweep", "parent_run_id": "parent123"},
        }
        (directory / "sweep.json").write_text(json.dumps(sweep), encoding="utf-8")
    (directory / "best_layout.yaml").write_text("# test fixture\nlayout: {tp: 2}\n", encoding="utf-8")
    return directory


def _text_outside_scripts(page: str) -> str:
    # plotly.js itself contains "<script" strings; only the report's own markup must be free of user script tags.
    return re.sub(r"<script\b.*?</script>", "", page, flags=re.S)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    sweep_dir = write_fixture_sweep(tmp_path_factory.mktemp("sweep"), torn_tail=True)
    path = render_report(sweep_dir)
    return path, path.read_text(encoding="utf-8")


def test_report_has_every_section(rendered: tuple[Path, str]) -> None:
    path, page = rendered
    assert path.name == REPORT_FILE
    for anchor in ("best", "counts", "throughput-memory", "pareto", "memory-accuracy", "failures", "axis-effects",
                   "attempts"):
        assert f"id='{anchor}'" in page, anchor
    assert "fixture-sweep &lt;test&gt;" in page
    assert "tiny-moe-fixture" in page
    assert "2 × 8 GPUs, 80.0 GiB each" in page
    assert "Median absolute error of the memory prediction" in page
    assert "Top pruned reasons" in page


def test_header_shows_best_headroom_and_counts(rendered: tuple[Path, str]) -> None:
    _, page = rendered
    best = _layout(tp=2, pp=1, ep=4, sp=True, precision="bf16").short()
    assert f"Best stable layout: <b>{best}</b>" in page
    assert "confirmed by 2/2 runs" in page
    assert "52,000 tokens/s" in page and "60.50 GiB peak memory" in page
    assert '<a href="best_layout.yaml">best_layout.yaml</a>' in page
    assert "72.0 GiB" in page  # (1 - 0.10) x 80
    # 7 distinct explore trials launched (0-6), 8 attempts, trial 6 retried after infra
    assert "7 trials (8 attempts, 1 retried)" in page
    assert "<td>Passed (stable)</td><td>4</td>" in page
    assert "<td>Passed, over the memory headroom</td><td>1</td>" in page
    assert "oom 1" in page and "nan 1" in page and "infra 1" in page
    assert "invalid_layout 2" in page
    assert "2 passed of 2" in page


def test_header_says_what_the_checkpoints_took_on_disk(rendered: tuple[Path, str]) -> None:
    """Issue 43: the report shows each trial's checkpoint size and what stayed on disk."""
    _, page = rendered
    assert "7 saved, up to 1.50 GiB each; 0 kept past their reload, 7 deleted after it" in page


def test_every_attempt_is_a_table_row(rendered: tuple[Path, str]) -> None:
    _, page = rendered
    table = page.split("id='attempts'", 1)[1]
    assert table.count("<tr>") == 1 + 13  # header + every readable line (the torn one is skipped)
    assert "run006a1e" in table and "run006a2e" in table and "run000a2c" in table
    assert "not stable" in table


def test_user_text_is_escaped(rendered: tuple[Path, str]) -> None:
    _, page = rendered
    assert "alert('pwned')" not in page
    assert "&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt; &amp; more" in page
    assert "<script>alert" not in _text_outside_scripts(page)


def test_plotly_js_inlined_once(rendered: tuple[Path, str]) -> None:
    _, page = rendered
    assert page.count("* plotly.js v") == 1
    assert not re.search(r"<script[^>]*\bsrc=", page)  # nothing fetched: readable offline
    assert page.count('class="plotly-graph-div"') == 4


def test_torn_last_line_is_skipped_and_reported(tmp_path: Path) -> None:
    write_fixture_sweep(tmp_path, torn_tail=True)
    rows, skipped = load_trials(tmp_path / "trials.jsonl")
    assert (len(rows), skipped) == (13, 1)
    assert "1 line(s) of trials.jsonl could not be read" in render_report(tmp_path).read_text(encoding="utf-8")


def test_pareto_front_is_stable_and_non_dominated(tmp_path: Path) -> None:
    from sweeper.report.render import _classify

    write_fixture_sweep(tmp_path)
    rows, _ = load_trials(tmp_path / "trials.jsonl")
    _classify(rows, 72.0)
    front = pareto_front(rows)
    # 76.5 GiB trial 1 is over the limit; trial 6 (47 GiB, 44k) is beaten by nothing cheaper and faster
    assert [r.number for r in front] == [3, 2, 6, 0]


def test_works_without_sweep_json(tmp_path: Path) -> None:
    write_fixture_sweep(tmp_path, with_sweep_json=False)
    page = render_report(tmp_path).read_text(encoding="utf-8")
    assert "sweep.json is missing" in page
    assert "Fastest stable attempt recorded" in page
    assert "id='attempts'" in page
    assert "not stable</span>" not in page  # no limit known, so nothing is marked over it


def test_host_memory_caveat(tmp_path: Path) -> None:
    write_fixture_sweep(tmp_path)
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    sweep["memory_kind"] = "host"
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    page = render_report(tmp_path).read_text(encoding="utf-8")
    assert "Memory is host RSS" in page and "peak host RSS per rank" in page
    # GPU-predicted memory is not drawn against host RSS: a sentence says why instead.
    assert "Median absolute error of the memory prediction" not in page
    assert "the two are not comparable" in page
    assert "predicted_vs_measured" not in report_figures(tmp_path) and "throughput_vs_memory" in report_figures(tmp_path)


def test_no_empty_panel_when_nothing_failed(tmp_path: Path) -> None:
    from sweeper.report.figures import failures_and_pruned

    assert failures_and_pruned(Counter(), Counter()) is None
    only_pruned = failures_and_pruned(Counter(), Counter({"invalid_layout": 3}))
    assert only_pruned is not None and [a.text for a in only_pruned.layout.annotations] == [
        "Pruned layouts by reason kind"]
    both = failures_and_pruned(Counter({"oom": 1}), Counter({"invalid_layout": 3}))
    assert both is not None and len(both.layout.annotations) == 2


def test_no_stable_layout_says_why(tmp_path: Path) -> None:
    write_fixture_sweep(tmp_path)
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    sweep["best"] = None
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    lines = [json.loads(x) for x in (tmp_path / "trials.jsonl").read_text().splitlines()]
    kept = [x for x in lines if x["result"]["status"] != "passed"]
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(x) + "\n" for x in kept))
    page = render_report(tmp_path).read_text(encoding="utf-8")
    assert "No stable layout was selected." in page
    assert "none passed within the memory headroom" in page


def test_write_is_atomic_and_replaces(tmp_path: Path) -> None:
    write_fixture_sweep(tmp_path)
    (tmp_path / REPORT_FILE).write_text("old report")
    before = set(p.name for p in tmp_path.iterdir())
    path = render_report(tmp_path)
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert set(p.name for p in tmp_path.iterdir()) == before  # no temp file left behind


def test_not_a_sweep_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a sweep directory"):
        render_report(tmp_path)
    assert not (tmp_path / REPORT_FILE).exists()


def test_sweep_with_no_trials_yet(tmp_path: Path) -> None:
    write_fixture_sweep(tmp_path)
    (tmp_path / "trials.jsonl").write_text("")
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    sweep.update(status="running", best=None)
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    page = render_report(tmp_path).read_text(encoding="utf-8")
    assert "still running" in page and "Every trial attempt (0)" in page
    assert page.count("* plotly.js v") == 0  # no figure, so no plotly.js either


def test_mlflow_runs_link_to_a_tracking_server_and_not_to_a_local_store(tmp_path: Path) -> None:
    write_fixture_sweep(tmp_path)
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    lines = [json.loads(x) for x in (tmp_path / "trials.jsonl").read_text().splitlines()]
    lines[0]["mlflow_run_id"] = "abc123"
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    sweep["mlflow"] = {"tracking_uri": "sqlite:///mlflow.db", "experiment_id": "7", "parent_run_id": "p1"}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    assert "#/experiments/" not in render_report(tmp_path).read_text(encoding="utf-8")
    sweep["mlflow"]["tracking_uri"] = "http://mlflow.internal:5000/"
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    page = render_report(tmp_path).read_text(encoding="utf-8")
    assert '<a href="http://mlflow.internal:5000/#/experiments/7/runs/abc123">abc123</a>' in page
    assert 'href="http://mlflow.internal:5000/#/experiments/7/runs/p1">open the sweep' in page
