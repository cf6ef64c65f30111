"""benchmarks/trial_overhead.py's spaces stay loadable and their default layouts launchable (no trial runs here: the
``--gpu`` one needs a GPU, and the CPU one is measured by the benchmark itself)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trial_overhead as bench  # noqa: E402

from sweeper.config.load import load_config  # noqa: E402
from sweeper.config.schema import layout_from_string  # noqa: E402
from sweeper.plan.assess import assess  # noqa: E402

# What local_gpus() reports for one H200, for eight 80 GiB H100s, and for a 24 GiB card of an older family.
DEVICES = [
    {"gpus": "1", "world_sizes": "1", "memory_gib": "141", "capability": "9.0", "name": "NVIDIA H200"},
    {"gpus": "8", "world_sizes": "1, 8", "memory_gib": "80", "capability": "9.0", "name": "NVIDIA H100 80GB HBM3"},
    {"gpus": "1", "world_sizes": "1", "memory_gib": "24", "capability": "8.9", "name": "NVIDIA L4"},
]


def load(tmp_path: Path, text: str):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("gpu", DEVICES, ids=lambda d: d["name"])
def test_the_gpu_space_is_a_local_instance_whose_default_layout_fits(tmp_path: Path, gpu: dict) -> None:
    cfg = load(tmp_path, bench.space_text(bench.GPU_STEPS, warm=True, gpu=gpu))
    assert not cfg.cluster.simulate and cfg.cluster.address == "local"
    assert cfg.cluster.gpus_per_node == int(gpu["gpus"]) and cfg.training.steps == 20
    entry = assess(cfg, layout_from_string(cfg, bench.GPU_LAYOUT))
    assert entry.valid, entry.reasons
    assert entry.predicted is not None and entry.predicted.fits, entry.predicted


@pytest.mark.parametrize("warm", [True, False])
def test_the_cpu_space_is_simulated_and_its_default_layout_launchable(tmp_path: Path, warm: bool) -> None:
    cfg = load(tmp_path, bench.space_text(bench.CPU_STEPS, warm=warm))
    assert cfg.cluster.simulate is True and cfg.cluster.warm_ranks is warm
    entry = assess(cfg, layout_from_string(cfg, bench.CPU_LAYOUT))
    assert entry.launchable, entry.reasons


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_gpu_mode_without_a_gpu_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.local_gpus()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err
