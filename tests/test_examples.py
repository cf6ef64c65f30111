"""The examples in examples/ work against this checkout: the Python ones run, the search YAMLs plan, the Slurm
script is valid bash and the KubeRay manifest is a RayJob whose space matches its Ray cluster. Seconds, no Ray,
no network: `plan` is offline, and nothing here connects to a cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from sweeper.config.load import load_config
from sweeper.record.schema import SweepMeta, TrialMetrics, TrialRecord, TrialResult
from sweeper.record.sweepdir import SweepDir
from sweeper.space.layout import Layout

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SHORT_NAME = re.compile(r"\bTP\d+-PP\d+(?:-[A-Za-z0-9+:.-]+)*-(?:fp32|fp16|bf16|fp8|mxfp8)\b")


def _run(*args: str | Path, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # read at call time: conftest's SWEEPER_CACHE included
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


# -- (a) plan from Python ----------------------------------------------------------------------------------------------
def test_plan_from_python_prints_counts_and_the_best_layouts_of_the_default_space() -> None:
    proc = _run(sys.executable, EXAMPLES / "plan_from_python.py")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("nemotron-3-nano-2x8: nemotron-3-nano-30b-a3b on 2 x 8 GPUs")
    counts = re.findall(r"^(\d+) layouts: (\d+) valid, (\d+) launchable", out, flags=re.MULTILINE)
    assert len(counts) == 2  # the whole space, then the --only filter
    (total, valid, launchable), (only_total, _, _) = (tuple(map(int, c)) for c in counts)
    assert total >= valid >= launchable > 0 and 0 < only_total < total
    assert "--only 'gpus=8,tp=1':" in out
    best = [line for line in out.splitlines() if SHORT_NAME.search(line) and "tokens/s" in line]
    assert len(best) == 10  # five per plan, each with its predicted throughput and memory
    assert all("GiB (band " in line for line in best)


def test_plan_from_python_refuses_a_bad_only_filter_in_one_line() -> None:
    proc = _run(sys.executable, EXAMPLES / "plan_from_python.py", "quickstart.yaml", "--only", "tpp=2")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --only: unknown key 'tpp'")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# -- (b) the example search YAMLs plan ---------------------------------------------------------------------------------
@pytest.mark.parametrize("space", ["custom_model_from_hf/space.yaml", "two_node_cluster.yaml"])
def test_example_space_plans_through_the_command_line(space: str, tmp_path: Path) -> None:
    # From another working directory: hf_config: config.json is read next to the YAML, not from the cwd.
    proc = _run(sys.executable, "-m", "sweeper", "plan", EXAMPLES / space, "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    entries = json.loads(proc.stdout)
    assert any(e["valid"] and e["predicted"]["fits"] for e in entries)
    assert any(not e["valid"] and e["reasons"] for e in entries)
    assert not list(tmp_path.iterdir())  # plan writes nothing


def test_custom_model_is_read_from_its_hf_config() -> None:
    cfg = load_config(EXAMPLES / "custom_model_from_hf" / "space.yaml")
    model = cfg.model
    assert model.name == "qwen3-moe-8b-a2b"
    assert (model.num_layers, model.hidden_size, model.num_moe_experts, model.moe_router_topk) == (24, 2048, 64, 8)
    assert model.qk_layernorm and model.num_query_groups == 4 and model.moe_ffn_hidden_size == 768


def test_two_node_cluster_plans_without_contacting_the_cluster_or_importing_ray() -> None:
    """plan on a space with a remote cluster.address: any socket connection fails the run, and Ray stays unloaded."""
    script = (
        "import socket, sys\n"
        "def refuse(*args, **kwargs):\n"
        "    raise AssertionError(f'network use: {args}')\n"
        "socket.socket.connect = socket.socket.connect_ex = socket.create_connection = refuse\n"
        "from sweeper.cli import main\n"
        f"code = main(['plan', {str(EXAMPLES / 'two_node_cluster.yaml')!r}, '--json'])\n"
        "assert 'ray' not in sys.modules, 'plan imported ray'\n"
        "sys.exit(code)\n"
    )
    proc = _run(sys.executable, "-c", script)
    assert proc.returncode == 0, proc.stderr
    cfg = load_config(EXAMPLES / "two_node_cluster.yaml")
    assert cfg.cluster.address not in ("auto", "local") and (cfg.cluster.nodes, cfg.cluster.gpus_per_node) == (2, 8)
    assert cfg.tracking.mlflow_tracking_uri is not None


# -- (c) the Slurm script ----------------------------------------------------------------------------------------------
def test_slurm_script_is_valid_bash_and_runs_ray_doctor_and_search() -> None:
    script = EXAMPLES / "slurm" / "sweeper_ray.sbatch"
    proc = _run("bash", "-n", script)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    directives = [line.split()[1].split("=")[0] for line in text.splitlines() if line.startswith("#SBATCH ")]
    for option in ("--nodes", "--gpus-per-node", "--exclusive", "--time"):
        assert option in directives
    for command in ("ray start --head", "ray start --address", "sweeper doctor", "sweeper search", "ray stop"):
        assert command in text
    assert "--address \"$ADDRESS\"" in text


# -- (d) the KubeRay manifest ------------------------------------------------------------------------------------------
def _kuberay_objects() -> dict[str, Any]:
    docs = list(yaml.safe_load_all((EXAMPLES / "kuberay" / "rayjob.yaml").read_text()))
    docs += list(yaml.safe_load_all((EXAMPLES / "kuberay" / "pvc.yaml").read_text()))
    return {doc["kind"]: doc for doc in docs}


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def test_kuberay_rayjob_has_a_head_and_gpu_workers_sharing_one_volume(tmp_path: Path) -> None:
    objects = _kuberay_objects()
    job = objects["RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    workers = cluster["workerGroupSpecs"]
    assert len(workers) == 1
    worker = workers[0]["template"]["spec"]
    gpus = worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) == 8

    # The sweep folder's claim is mounted at the same path on the head and on the workers.
    claim = objects["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    volume = {v["name"] for v in head["volumes"] + worker["volumes"]
              if v.get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]}
    assert len(volume) == 1
    (name,) = volume
    shared = _mounts(head["containers"][0])[name]
    assert _mounts(worker["containers"][0])[name] == shared

    # The entrypoint runs the ConfigMap's script, which runs doctor and search on the ConfigMap's space.
    config_map = objects["ConfigMap"]
    assert any(v.get("configMap", {}).get("name") == config_map["metadata"]["name"] for v in head["volumes"])
    script = config_map["data"]["run.sh"]
    assert "run.sh" in spec["entrypoint"]
    assert "python -m sweeper doctor" in script and "python -m sweeper search" in script
    (tmp_path / "run.sh").write_text(script)
    proc = _run("bash", "-n", tmp_path / "run.sh")
    assert proc.returncode == 0, proc.stderr

    # The space describes this Ray cluster and keeps its records on the shared volume.
    (tmp_path / "space.yaml").write_text(config_map["data"]["space.yaml"])
    cfg = load_config(tmp_path / "space.yaml")
    assert cfg.cluster.nodes == workers[0]["replicas"] and cfg.cluster.gpus_per_node == int(gpus)
    assert cfg.cluster.address == "auto"
    assert cfg.tracking.mlflow_tracking_uri is not None and shared in cfg.tracking.mlflow_tracking_uri
    assert '--out "$OUT"' in script and f"OUT={shared}/" in script


# -- (e) reading a sweep folder ----------------------------------------------------------------------------------------
def _layout(**axes: Any) -> dict[str, Any]:
    return Layout(gbs=8, **axes).to_dict()


def _result(status: Any, kind: Any = None, error: str | None = None, tokens: float | None = None,
            peak: float | None = None, step: float | None = None) -> TrialResult:
    metrics = TrialMetrics(tokens_per_s=tokens, step_time_s=step, peak_memory_gib=peak,
                           tflops_per_gpu=None if tokens is None else tokens / 1e5)
    return TrialResult(status=status, failure_kind=kind, error=error, metrics=metrics,
                       backend="megatron-core-cpu", memory_kind="host")


def _write_sweep(root: Path) -> None:
    """A small sweep folder written with sweeper's own record classes. TEST DATA for the reader, not trial
    results: every number below is made up, no trial ran."""
    sweep = SweepDir(root)
    sweep.create()
    records = [
        TrialRecord(0, _layout(world_size=2, pp=2, mbs=2), _result("passed", tokens=5200.0, peak=0.91, step=0.098)),
        TrialRecord(1, _layout(world_size=2, ep=2, mbs=2), _result("passed", tokens=6100.0, peak=0.87, step=0.084)),
        TrialRecord(2, _layout(world_size=4, tp=2, pp=2, mbs=2),
                    _result("failed", "oom", "test data: rank 3 exceeded the simulated 4 GiB", peak=4.2)),
        TrialRecord(3, _layout(world_size=4, ep=4, mbs=1), _result("failed", "infra", "test data: node lost"),
                    attempt=1),
        TrialRecord(3, _layout(world_size=4, ep=4, mbs=1), _result("passed", tokens=9050.0, peak=0.95, step=0.113),
                    attempt=2),
        TrialRecord(4, _layout(world_size=2, tp=2, ep=1, mbs=1),
                    _result("pruned", "invalid_layout", "test data: expert_tensor_parallel_size (1) != ..."),
                    attempt=0),
    ]
    for record in records:
        record.predicted = {"memory_gib": 0.8, "fits": True}
        sweep.append_trial(record)
    with sweep.trials.open("a") as f:
        f.write('{"number": 5, "layout": {"tp"')  # a torn last line, as a killed driver leaves
    sweep.write_meta(SweepMeta(name="examples-test", status="finished", memory_kind="host", memory_headroom=0.1,
                               cluster={"gpu_memory_gib": 4.0}, best={"number": 3, "layout": "TP1-PP1-EP4-DP4"}))


def test_read_trials_tabulates_a_sweep_folder(tmp_path: Path) -> None:
    """The reader on a folder of made-up records (_write_sweep: test data, not trial results)."""
    root = tmp_path / "sweeps" / "examples-test"
    _write_sweep(root)
    csv = tmp_path / "trials.csv"
    proc = _run(sys.executable, EXAMPLES / "read_trials.py", root, "--csv", csv)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "sweep examples-test: status finished, 6 trial records (1 unreadable lines skipped)" in out
    assert "host RSS" in out
    passed, _, failed = out.partition("not passed (3)")
    assert "passed (3), fastest first:" in passed
    assert passed.index("9050") < passed.index("6100") < passed.index("5200")
    for kind in ("oom", "infra", "invalid_layout"):
        assert kind in failed

    df = pd.read_csv(csv)
    for column in ("gpus", "tp", "pp", "cp", "dp", "ep", "etp", "edp", "vpp", "sp", "mbs", "gbs", "precision",
                   "recompute", "status", "failure_kind", "tokens_per_s", "peak_memory_gib", "step_time_s"):
        assert column in df.columns
    assert len(df) == 6 and sorted(df["status"].unique()) == ["failed", "passed", "pruned"]
    best = df.sort_values("tokens_per_s", ascending=False).iloc[0]
    assert (best["number"], best["attempt"], best["gpus"], best["ep"], best["edp"]) == (3, 2, 4, 4, 1)


def test_read_trials_refuses_a_folder_without_trials(tmp_path: Path) -> None:
    proc = _run(sys.executable, EXAMPLES / "read_trials.py", tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path}: not a sweep folder (no trials.jsonl)"


def test_every_example_is_listed_in_the_examples_readme() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    for item in ("plan_from_python.py", "custom_model_from_hf/", "read_trials.py", "two_node_cluster.yaml",
                 "slurm/", "kuberay/"):
        assert f"**`{item}`**" in readme


def test_no_two_shipped_spaces_share_a_name() -> None:
    """The sweep folder is sweeps/<name>/: two shipped YAMLs of one name would write into each other's sweep."""
    from sweeper.config.load import SHIPPED_SPACES

    paths = sorted(SHIPPED_SPACES.glob("*.yaml")) + sorted(EXAMPLES.rglob("*.yaml"))
    names: dict[str, Path] = {}
    for path in paths:
        docs = list(yaml.safe_load_all(path.read_text()))
        doc = docs[0] if len(docs) == 1 else None
        if not isinstance(doc, dict) or "name" not in doc or "model" not in doc:
            continue  # not a search space (e.g. a Kubernetes manifest)
        assert doc["name"] not in names, f"{path} and {names[doc['name']]} are both named {doc['name']!r}"
        names[doc["name"]] = path
    assert len(names) >= 7
