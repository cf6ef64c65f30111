"""Bad input never gives a traceback: each case exits 2 with one line naming the field, and writes nothing. A cluster
address that does not answer exits 1 with one line, at once for a refused port (a real one on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sweeper.cli import main

ROOT = Path(__file__).resolve().parents[1]

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
    ("name: t\nmodel: tiny-gpt\nbudget: {tokens: -1}\n", "budget.tokens: must be greater than 0"),
    ("name: t\nmodel: tiny-gpt\nbudget: {gpu_hour_usd: 2.5}\n", "budget.tokens: required"),
    ("name: t\nmodel: tiny-gpt\nbudget: {tokens: 1e12, gpus: 0}\n", "budget.gpus: must be a positive integer"),
    ("name: t\nmodel: tiny-gpt\nestimate: {throughput_low: 2, throughput_high: 1.5}\n",
     "throughput_low (2.0) must not exceed throughput_high (1.5)"),
    ("name: t\nmodel: [tiny-gpt\n", "YAML syntax error at line"),
    ("- just\n- a list\n", "expected a mapping of sections"),
    ("", "expected a mapping of sections"),
    ("name: t\nmodel: {preset: tiny-moe, moe_router_topk: 9}\n", "moe_router_topk (9) exceeds num_moe_experts (4)"),
    ("name: t\nmodel: {preset: tiny-gpt, hybrid_layer_pattern: 'MMX*'}\n", "unknown symbols"),
    # a YAML true, 2.0 or "8" is not an integer, .inf is not a size; nothing falls back silently
    ("name: t\nmodel: tiny-gpt\nspace: {tp: [true]}\n", "space.tp[0]: must be an integer, got True"),
    ("name: t\nmodel: tiny-gpt\ncluster: {nodes: '2'}\n", "cluster.nodes: must be an integer, got '2'"),
    ("name: t\nmodel: tiny-gpt\ntraining: {steps: 4.0}\n", "training.steps: must be an integer, got 4.0"),
    ("name: t\nmodel: tiny-gpt\ncluster: {gpu_memory_gib: .inf}\n", "cluster.gpu_memory_gib: must be a finite number"),
    ("name: t\nmodel: tiny-gpt\nestimate: {cuda_context_gib: .nan}\n", "estimate.cuda_context_gib: must be a finite"),
    ("name: t\nmodel: tiny-gpt\nestimate: {cuda_context_gib: true}\n", "estimate.cuda_context_gib: must be a number"),
    ("name: t\nmodel: {preset: tiny-gpt, num_layers: true}\n", "model.num_layers: must be a number, got True"),
    ("name: t\nmodel: tiny-gpt\ncluster: {simulate: 1}\n", "cluster.simulate"),
    ("name: t\nmodel: tiny-gpt\nsource: x.yaml\n", "source: unknown key"),
    ("name: t\nmodel: tiny-gpt\nx: &a [*a]\n", "x: unknown key"),  # an alias to itself
    ("name: t\nmodel: tiny-gpt\ncluster: &a [*a]\n", "cluster: must be a mapping, got [[[...]]]"),
    ("name: t\nmodel: tiny-gpt\n" + "".join(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}" if i else "1"] * 10) + "]\n"
                                            for i in range(9)) + "cluster: *a8\n",  # 10**9 leaves once expanded
     "cluster: must be a mapping, got [[[...], [...], [...], [...], ...]"),
    ("name: t\nmodel: tiny-gpt\nx: " + "[" * 3000 + "]" * 3000 + "\n", "YAML nested too deeply"),
    ("name: t\nmodel: tiny-gpt\nsearch: {seeds: ['tp=2,tp=2']}\n", "search.seeds[0]: 'tp' given twice"),
    # cluster.address and simulate
    ("name: t\nmodel: tiny-gpt\ncluster: {address: head}\n",
     "cluster.address: must be auto, local, HOST:PORT or ray://HOST:PORT, got 'head'"),
    ("name: t\nmodel: tiny-gpt\ncluster: {address: '127.0.0.1:99999'}\n", "cluster.address: must be auto, local"),
    ("name: t\nmodel: tiny-gpt\ncluster: {simulate: true, address: '127.0.0.1:6379'}\n",
     "cluster.simulate: true cannot be combined with cluster.address '127.0.0.1:6379'"),
    ("name: t\nmodel: tiny-gpt\ncluster: {connect_timeout_s: 0}\n", "cluster.connect_timeout_s: must be greater than 0"),
]

ARG_CASES = [
    (["plan", "{space}", "--set", "training.steps"], "--set training.steps: expected section.field=value"),
    (["plan", "{space}", "--set", "training.steps=abc"], "training.steps: must be an integer, got 'abc'"),
    (["plan", "{space}", "--set", "model.num_layers=4"], "--set model.num_layers=4: model is 'tiny-gpt' in the YAML"),
    (["search", "{space}", "--set", "space.tpp=[2]"], "space.tpp: unknown key"),
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
    (["search", "{space}", "--inject", "hang@trial=٣"], "--inject: 'hang@trial=٣' is not one of"),
    (["search", "{seeded}"], "search.seeds[0]: tp must be a positive integer"),
    (["plan", "{space}", "--limit", "-1"], "--limit: must be 0 (all) or a positive integer, got -1"),
    (["plan", "{space}", "--only", "tp=\u00b2"], "--only: tp must be a positive integer, got '\u00b2'"),
    # Nothing matched is said, not printed as an empty plan.
    (["plan", "{space}", "--only", "tp=4"], "--only: tp=4 is not in the space (space.tp: [1, 2]); no layout matched"),
    (["plan", "{space}", "--json", "--only", "tp=2,pp=2,gpus=2"], "--only: no layout of the space has tp=2,pp=2,gpus=2"),
    (["search", "{simulated}", "--address", "127.0.0.1:6379"],
     "--address: '127.0.0.1:6379' cannot be combined with cluster.simulate: true"),
    (["trial", "{simulated}", "--layout", "tp=1", "--address", "local"], "--address: 'local' cannot be combined"),
    (["doctor", "{space}", "--address", "127.0.0.1"], "--address: must be auto, local, HOST:PORT or ray://HOST:PORT"),
    (["search", "{space}", "--address", "ray://:1"], "--address: must be auto, local"),
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
    simulated = tmp_path / "simulated.yaml"
    if any("{simulated}" in a for a in argv):
        simulated.write_text(GOOD.replace("gpu_memory_gib: 4}", "gpu_memory_gib: 4, simulate: true}"))
    before = sorted(tmp_path.iterdir())
    argv = [a.format(space=space, tmp=tmp_path, seeded=seeded, simulated=simulated) for a in argv]
    _assert_one_line_exit_2(capsys, main(argv), expected)
    assert sorted(tmp_path.iterdir()) == before


def test_argparse_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["search"], ["trial", "--layout", "tp=1,pp=1,gpus=2"], ["doctor"]])
def test_a_refused_address_is_one_line_at_once(tmp_path: Path, command: list[str]) -> None:
    """A real process, a real refused loopback port: one line, exit 1, within seconds, nothing written."""
    space = _write(tmp_path, GOOD)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sweeper", command[0], str(space), *command[1:], "--address",
                           "127.0.0.1:1"], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert time.monotonic() - started < 60  # interpreter and imports included; the probe itself is immediate
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == ("error: --address: no Ray cluster answers at 127.0.0.1:1: connection refused "
                                   "(cluster.connect_timeout_s: 10)")
    assert proc.stdout == ""
    assert not list(cwd.iterdir())  # no sweep folder, no MLflow store


def test_a_tracking_server_that_does_not_answer_is_one_line_before_any_trial(tmp_path: Path) -> None:
    """Issue 34: MLflow's client retried a refused tracking server for 4 min 14 s, then printed a traceback (measured
    on this machine). Now: a real refused loopback port, one line, exit 1, within seconds; no sweep folder, no Ray."""
    space = _write(tmp_path, GOOD)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sweeper", "search", str(space), "--set",
                           "tracking.mlflow_tracking_uri=http://127.0.0.1:1"], capture_output=True, text=True,
                          cwd=cwd, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert time.monotonic() - started < 60  # interpreter and imports included; the probe itself is immediate
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == ("error: tracking.mlflow_tracking_uri: no MLflow server answers at "
                                   "http://127.0.0.1:1: connection refused (tracking.connect_timeout_s: 10)")
    assert not list(cwd.iterdir())  # no sweep folder, no MLflow store


def test_library_modules_never_import_the_command_line() -> None:
    """Errors travel as sweeper.errors.SweeperError; only __main__ (and cli itself) know the command line."""
    import ast

    offenders = []
    for path in sorted((ROOT / "sweeper").rglob("*.py")):
        if path.name == "__main__.py" or path == ROOT / "sweeper" / "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name == "sweeper.cli" or name.startswith("sweeper.cli.") for name in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_real_process_prints_no_traceback(tmp_path: Path) -> None:
    space = _write(tmp_path, "name: t\nmodel: tiny-gpt\nspace: {tp: [-2]}\n")
    proc = subprocess.run([sys.executable, "-m", "sweeper", "plan", str(space)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {space}: space.tp[0]: must be a positive integer, got -2"
    assert proc.stdout == ""


def test_the_missions_command_from_the_repository_root_ends_in_seconds_with_one_line(tmp_path: Path) -> None:
    # `python -m sweeper search nemotron.yaml` as typed: the bare name finds search_spaces/nemotron.yaml; on a
    # machine without GPUs its trials would run on the CPU backend, which cannot run the 31.6B model: one line
    # saying so and what would make it run, exit 1, nothing written, no study started.
    root = Path(__file__).resolve().parents[1]
    work = tmp_path / "checkout"
    (work / "search_spaces").mkdir(parents=True)
    (work / "search_spaces" / "nemotron.yaml").write_text((root / "search_spaces" / "nemotron.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "sweeper", "search", "nemotron.yaml"], cwd=work, capture_output=True,
                          text=True, timeout=120, env={**env, "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"using {Path('search_spaces') / 'nemotron.yaml'} (the shipped search space named nemotron.yaml)"
    error = lines[-1]
    assert error.startswith("error: nemotron.yaml: no layout of this space can run on the CPU backend"), error
    assert "31.6B-parameter model" in error and "--proxy" in error and "--address" in error
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted(p.name for p in work.iterdir()) == ["search_spaces"]  # no sweeps/, no mlruns/


def test_plan_with_proxy_gives_the_real_models_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    space = str(Path(__file__).resolve().parents[1] / "search_spaces" / "deepseek_v2_lite.yaml")
    assert main(["plan", space, "--json"]) == 0
    real = json.loads(capsys.readouterr().out)
    assert main(["plan", space, "--json", "--proxy"]) == 0
    small = json.loads(capsys.readouterr().out)
    def verdicts(entries: list[dict]) -> list[tuple[str, bool]]:  # the proxy's CPU-size batch aside
        return sorted((json.dumps({k: v for k, v in e["layout"].items() if k != "gbs"}, sort_keys=True), e["valid"])
                      for e in entries)

    assert len(real) > 1000 and verdicts(real) == verdicts(small)
    def memory(entries: list[dict]) -> list[float]:
        return [e["predicted"]["memory_gib"] for e in entries if e["predicted"]["memory_gib"] is not None]

    assert max(memory(small)) < min(memory(real))


def test_set_overrides_a_field_of_the_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    space = _write(tmp_path, GOOD)
    assert main(["plan", str(space), "--json", "--set", "space.tp=[2]", "--set", "space.pp=[1]"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {(e["layout"]["tp"], e["layout"]["pp"]) for e in plan} == {(2, 1)}


def test_version_names_sweeper_and_the_stack_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("sweeper ") and "megatron-core 0.16" in out and len(out.splitlines()) == 1
