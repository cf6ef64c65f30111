"""Bad input never gives a traceback: each case exits 2 with one line naming the field, and writes nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sweeper.cli import main

GOOD = textwrap.dedent(
    """\
    name: t
    model: tiny-gpt
    cluster: {nodes: 2, gpus_per_node: 2, gpu_memory_gib: 4}
    training: {seq_length: 64, global_batch_size: 8, steps: 4}
    space: {tp: [1, 2], pp: [1, 2]}
    """
)

# (YAML text or None for "use GOOD", extra CLI args, text the one-line error must contain)
YAML_CASES = [
    ("name: t\nmodel: tiny-gpt\nspace: {tp: [-2]}\n", "space.tp[0]: must be a positive integer, got -2"),
    ("name: t\nmodel: tiny-gpt\nspace: {tp: [0]}\n", "space.tp[0]: must be a positive integer"),
    ("name: t\nmodel: tiny-gpt\nspace: {tp: 2}\n", "space.tp: must be a list"),
    ("name: t\nmodel: tiny-gpt\nspace: {tp: []}\n", "space.tp: must list at least one value"),
    ("name: t\nmodel: tiny-gpt\nspace: {tp: [two]}\n", "space.tp[0]: must be an integer"),
    ("name: t\nmodel: tiny-gpt\nspace: {tpp: [2]}\n", "space.tpp: unknown key"),
    ("name: t\nmodel: tiny-gpt\nspace: {precision: [fp4]}\n", "space.precision[0]: must be one of"),
    ("name: t\nmodel: tiny-gpt\nspace: {recompute: [some]}\n",
     "space.recompute: must be one of none, selective, full or selective:<modules>"),
    ("name: t\nmodel: tiny-gpt\nspace: {recompute: ['selective:moe_ac']}\n", "space.recompute: unknown module 'moe_ac'"),
    ("name: t\nmodel: tiny-gpt\nspace: {sp: [maybe]}\n", "space.sp[0]"),
    ("name: t\nmodel: tiny-gpt\nspace: {gpus: [64]}\n", "space.gpus[0]: 64 GPUs requested but the cluster has"),
    ("name: t\nmodel: tiny-gpt\nbogus: 1\n", "bogus: unknown key"),
    ("model: tiny-gpt\n", "name: required"),
    ("name: 'a b'\nmodel: tiny-gpt\n", "name: must be letters"),
    ("name: t\n", "model: required"),
    ("name: t\nmodel: gpt-17\n", "model: unknown preset 'gpt-17'"),
    ("name: t\nmodel: 42\n", "model: must be a preset name or a mapping"),
    ("name: t\nmodel: {preset: tiny-gpt, num_layers: -1}\n", "model.num_layers: must be a positive integer"),
    ("name: t\nmodel: {preset: tiny-gpt, layers: 3}\n", "model.layers: unknown key"),
    ("name: t\nmodel: {num_layers: 2, hidden_size: 8}\n", "model.ffn_hidden_size: required"),
    ("name: t\nmodel: {hf_config: missing.json}\n", "missing.json"),
    ("name: t\nmodel: {hf_config: x.json, foo: 1}\n", "model.foo: unknown key next to hf_config"),
    ("name: t\nmodel: tiny-gpt\ncluster: {nodes: 0}\n", "cluster.nodes: must be a positive integer, got 0"),
    ("name: t\nmodel: tiny-gpt\ncluster: {gpus_per_node: x}\n", "cluster.gpus_per_node: must be an integer"),
    ("name: t\nmodel: tiny-gpt\ncluster: {gpu_memory_gib: -1}\n", "cluster.gpu_memory_gib: must be greater than 0"),
    ("name: t\nmodel: tiny-gpt\ncluster: {compute_capability: nine}\n", "cluster.compute_capability: must look like"),
    ("name: t\nmodel: tiny-gpt\ncluster: {simulate: sometimes}\n", "cluster.simulate"),
    ("name: t\nmodel: tiny-gpt\ntraining: {steps: 2, warmup_steps: 2}\n", "warmup_steps (2) must be smaller"),
    ("name: t\nmodel: tiny-gpt\ntraining: {seq_length: 1.5}\n", "training.seq_length: must be an integer"),
    ("name: t\nmodel: tiny-gpt\nsearch: {memory_headroom: 1.5}\n", "search.memory_headroom: must be < 1"),
    ("name: t\nmodel: tiny-gpt\nsearch: {objective: loss}\n", "search.objective: must be one of"),
    ("name: t\nmodel: tiny-gpt\nsearch: {parallel: -1}\n", "search.parallel"),
    ("name: t\nmodel: tiny-gpt\ntracking: {experimnt: x}\n", "tracking.experimnt: unknown key"),
    ("name: t\nmodel: tiny-gpt\nestimate: {allocator_fragmentation: 0}\n", "estimate.allocator_fragmentation"),
    ("name: t\nmodel: [tiny-gpt\n", "YAML syntax error at line"),
    ("- just\n- a list\n", "expected a mapping of sections"),
    ("", "expected a mapping of sections"),
    ("name: t\nmodel: {preset: tiny-moe, moe_router_topk: 9}\n", "moe_router_topk (9) exceeds num_moe_experts (4)"),
    ("name: t\nmodel: {preset: tiny-gpt, hybrid_layer_pattern: 'MMX*'}\n", "unknown symbols"),
]

ARG_CASES = [
    (["plan", "{space}", "--only", "tp"], "--only: 'tp' is not key=value"),
    (["plan", "{space}", "--only", "tq=2"], "--only: unknown key 'tq'"),
    (["plan", "{space}", "--only", "tp=-1"], "--only: tp must be a positive integer"),
    (["plan", "{space}", "--only", "sp=perhaps"], "--only: sp must be true or false"),
    (["plan", "{space}", "--only", "tp=2,tp=4"], "--only: 'tp' given twice"),
    (["plan", "{space}", "--only", ""], "--only: empty"),
    (["trial", "{space}", "--layout", "tp=2,pp"], "--layout: 'pp' is not key=value"),
    (["trial", "{space}", "--layout", "precision=fp4"], "--layout: precision must be one of"),
    (["trial", "{space}", "--layout", "gpus=64"], "--layout: needs 64 GPUs but the cluster has 4"),
    (["trial", "{space}", "--layout", "tp=2,dp=4"], "--layout: needs 8 GPUs"),
    (["trial", "{space}", "--layout", "tp=2,dp=1,gpus=4"], "--layout: gpus=4 but tp*pp*cp*dp = 2"),
    (["plan", "nonexistent.yaml"], "nonexistent.yaml: no such file"),
    (["report", "{tmp}"], "not a sweep folder"),
    (["search", "{space}", "--max-trials", "0"], "--max-trials: must be a positive integer"),
    (["search", "{space}", "--inject", "meteor@trial=1"], "--inject: 'meteor@trial=1' is not one of"),
    (["search", "{seeded}"], "search.seeds[0]: tp must be a positive integer"),
]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def _assert_one_line_exit_2(capsys: pytest.CaptureFixture[str], code: int, expected: str) -> None:
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("text,expected", YAML_CASES)
def test_bad_yaml_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str) -> None:
    space = _write(tmp_path, text)
    before = sorted(tmp_path.iterdir())
    _assert_one_line_exit_2(capsys, main(["plan", str(space)]), expected)
    assert sorted(tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("argv,expected", ARG_CASES)
def test_bad_arguments_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    space = _write(tmp_path, GOOD)
    seeded = tmp_path / "seeded.yaml"
    if any("{seeded}" in a for a in argv):
        seeded.write_text(GOOD + "search: {seeds: ['tp=0']}\n")
    before = sorted(tmp_path.iterdir())
    argv = [a.format(space=space, tmp=tmp_path, seeded=seeded) for a in argv]
    _assert_one_line_exit_2(capsys, main(argv), expected)
    assert sorted(tmp_path.iterdir()) == before


def test_argparse_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_real_process_prints_no_traceback(tmp_path: Path) -> None:
    space = _write(tmp_path, "name: t\nmodel: tiny-gpt\nspace: {tp: [-2]}\n")
    proc = subprocess.run([sys.executable, "-m", "sweeper", "plan", str(space)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {space}: space.tp[0]: must be a positive integer, got -2"
    assert proc.stdout == ""
