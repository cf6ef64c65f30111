"""One real CPU-backend trial of a small space, through the command line (e2e helper of the pipeline-split tests):
the space written to ``tmp_path``, ``sweeper trial --layout LAYOUT --json`` run, and the result asserted passed with
its checkpoint reloaded and the equivalence gate within 1e-4 of the one-rank reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def write_space(tmp_path: Path, name: str, num_layers: int, gpus: int, space: dict[str, Any]) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "model": {"preset": "tiny-gpt", "num_layers": num_layers},
        "cluster": {"nodes": 1, "gpus_per_node": gpus, "gpu_memory_gib": 16, "compute_capability": "9.0",
                    "simulate": True},
        "training": {"seq_length": 32, "global_batch_size": 8, "steps": 2, "warmup_steps": 1, "checkpoint": True,
                     "trial_timeout_s": 600},
        "space": {"gpus": [gpus], **space, "precision": ["fp32"]},
    }))
    return path


def assert_trial_passes(tmp_path: Path, path: Path, layout: str, *extra: str, timeout: float = 900) -> dict[str, Any]:
    """``extra``: more options of ``sweeper trial`` (``--proxy``)."""
    proc = subprocess.run([sys.executable, "-m", "sweeper", "trial", str(path), *extra, "--layout", layout, "--json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["status"] == "passed", f"[{result['failure_kind']}] {result['error']}"
    assert result["checks"]["checkpoint_reloaded"] is True
    assert result["checks"]["equivalence_rel_err"] is not None and result["checks"]["equivalence_rel_err"] < 1e-4
    return result
