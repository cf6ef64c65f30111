"""doctor's findings from what each node reported (issue 51): on a cluster whose nodes advertise GPUs to Ray, a
node with GPUs (nvidia-smi lists them) whose torch cannot use them (a CPU build, no CUDA device seen, fewer devices
than Ray schedules) is a problem named with its fix; a node with no GPU at all behind Ray's (logical GPUs: its ranks
run on the CPU) and a node with fewer CPUs for Ray than GPUs (it runs fewer ranks) are warnings with theirs; a
simulated cluster's logical GPUs are neither. The probe itself runs on a real ``ray start`` node in tests/cluster/test_ray_start_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from sweeper.cluster.doctor import DoctorReport, NodeCheck, _logical_gpus, _problems, _short_of_cpus
from sweeper.config.load import load_config

ROOT = Path(__file__).resolve().parents[2]


def _cfg():  # one node of four GPUs
    cfg = load_config(ROOT / "search_spaces" / "quickstart.yaml")
    return cfg.model_copy(update=dict(cluster=cfg.cluster.model_copy(update=dict(nodes=1, gpus_per_node=4))))


def _node(**facts) -> NodeCheck:
    cfg = _cfg()
    base = dict(python="3.11", torch="2.13.0+cpu", megatron_core="0.16.1", gpu_count=4, cpus=8.0, shared=True,
                compute_capability=cfg.cluster.compute_capability)
    return NodeCheck("127.0.0.1", "a", **{**base, **facts})


@pytest.mark.parametrize(("facts", "problem", "cell"), [
    (dict(torch_cuda=None, cuda_devices=0),
     "127.0.0.1: Ray schedules 4 GPUs here but its torch 2.13.0+cpu is a CPU build: its ranks would run on the CPU. "
     "Install a CUDA build of torch there, or start Ray there with --num-gpus 0 (docs/gpu-cluster.md)", "CPU build"),
    (dict(torch="2.13.0+cu128", torch_cuda="12.8", cuda_devices=0),
     "127.0.0.1: Ray schedules 4 GPUs here but torch 2.13.0+cu128 (CUDA 12.8) sees no CUDA device: check the driver "
     "(nvidia-smi) and CUDA_VISIBLE_DEVICES there, or start Ray there with --num-gpus 0 (docs/gpu-cluster.md)",
     "0 devices (CUDA 12.8)"),
    (dict(torch="2.13.0+cu128", torch_cuda="12.8", cuda_devices=2),
     "127.0.0.1: Ray schedules 4 GPUs here but torch sees 2 CUDA devices: ranks beyond them would fail. Check "
     "CUDA_VISIBLE_DEVICES there, or start Ray there with --num-gpus 2 (docs/gpu-cluster.md)", "2 devices (CUDA 12.8)"),
    (dict(cuda_error="ModuleNotFoundError: No module named 'torch'"),
     "127.0.0.1: Ray schedules 4 GPUs here but torch could not say how many CUDA devices it sees: "
     "ModuleNotFoundError: No module named 'torch'", "?"),
])
def test_a_node_advertising_gpus_its_torch_cannot_use_is_a_problem_with_its_fix(facts, problem, cell) -> None:
    node = _node(gpu_source="nvidia-smi", gpu_kind="NVIDIA H100 80GB HBM3", **facts)
    assert _problems([node], _cfg(), "/scratch") == [problem]
    assert DoctorReport([node], [problem], 1).rows()[0]["cuda"] == cell


def test_a_node_whose_torch_sees_its_gpus_is_fine() -> None:
    node = _node(torch="2.13.0+cu128", torch_cuda="12.8", cuda_devices=4)
    assert _problems([node], _cfg(), "/scratch") == []


def test_a_simulated_clusters_logical_gpus_are_fine() -> None:
    """Their torch is not asked (cuda_devices None): the ranks run on the CPU by design."""
    node = _node(gpu_source="simulated")
    assert _problems([node], _cfg(), "/scratch") == []
    assert DoctorReport([node], [], 1).rows()[0]["cuda"] == "simulated"


def test_a_node_with_fewer_cpus_than_gpus_is_a_warning_naming_how_many_ranks_run_there() -> None:
    node = _node(torch="2.13.0+cu128", torch_cuda="12.8", cuda_devices=4, cpus=2.0)
    assert _problems([node], _cfg(), "/scratch") == []
    assert _short_of_cpus(node) == [
        "127.0.0.1: 4 GPUs but 2 CPUs for Ray: a rank reserves 1 CPU, so at most 2 ranks run here and layouts needing "
        "more per node do not (start Ray there with --num-cpus 4 or more)"]
    assert _short_of_cpus(_node(cpus=4.0)) == []


def test_a_node_whose_gpus_are_logical_is_a_warning_not_a_problem() -> None:
    """``ray start --num-gpus 4`` on a machine without GPUs: the sweep runs (on the CPU), and doctor says what that
    means and the fix for a GPU node where this was a mistake."""
    node = _node(torch_cuda=None, cuda_devices=0)  # no nvidia-smi GPU, torch a CPU build
    assert _problems([node], _cfg(), "/scratch") == []
    assert _logical_gpus(node) == [
        "127.0.0.1: Ray schedules 4 GPUs here but the node shows none (no GPU from nvidia-smi; its torch 2.13.0+cpu is "
        "a CPU build): logical GPUs, whose ranks run on the CPU and measure it, as on a simulated cluster. On a GPU "
        "node: install the NVIDIA driver and a CUDA build of torch; otherwise start Ray there with --num-gpus 0"]
    assert _logical_gpus(_node(gpu_source="simulated")) == []
