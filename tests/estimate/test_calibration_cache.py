"""The calibration cache other sweeps share (issue 54): keyed by a digest of everything a prediction reads, so a
changed model or fabric never reads another's factors; and a filesystem without locks costs the sharing, not the
sweep."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig
from sweeper.estimate import Calibration, Estimator
from sweeper.estimate import calibration as calibration_module
from sweeper.estimate.calibration import load, save
from sweeper.estimate.calibrator import (
    CLUSTER_FIELDS_NOT_PRICED,
    MODEL_FIELDS_NOT_PRICED,
    Calibrator,
    Measured,
    cache_path,
    cluster_key,
    key,
    stored,
)
from sweeper.plan.assess import assess_all
from sweeper.plan.space import enumerate_layouts
from sweeper.space.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((ROOT / "search_spaces" / "quickstart.yaml").read_text())


def _config(tmp_path: Path, **sections: Any) -> SweepConfig:
    """The quickstart space with whole sections replaced (``model=``) or cluster fields changed (``cluster=``)."""
    data = {**QUICKSTART, **sections, "cluster": {**QUICKSTART["cluster"], **sections.get("cluster", {})}}
    path = tmp_path / f"space-{len(list(tmp_path.glob('space-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def _predictions(cfg: SweepConfig) -> list[tuple[list[str], Any]]:
    """Every layout's plan entry: the rules' reasons and the estimator's prediction."""
    return [(e.reasons, e.predicted) for e in assess_all(cfg, enumerate_layouts(cfg))]


def test_a_preset_with_a_field_overridden_is_another_model(tmp_path: Path) -> None:
    plain = _config(tmp_path, model="tiny-moe")
    deeper = _config(tmp_path, model={"preset": "tiny-moe", "num_layers": 8})
    assert plain.model.name == deeper.model.name  # one name: the key of before could not tell them apart
    assert key(plain) != key(deeper)
    assert cluster_key(plain) == cluster_key(deeper)  # the cluster's shared link factors stay shared


def test_two_clusters_of_one_shape_on_other_fabrics_are_two_clusters(tmp_path: Path) -> None:
    base = _config(tmp_path)
    # Across the nodes, and offloading a layer's activations over a host link slow enough to show behind compute.
    layouts = [Layout(world_size=4, tp=2, sp=True, ep=2, gbs=8), Layout(world_size=2, gbs=8, offload_layers=1)]
    for field, value in (("intra_node_bandwidth_gbs", 450.0), ("inter_node_bandwidth_gbs", 50.0),
                         ("host_link_gbs", 0.001), ("gpu_kind", "h200")):
        other = _config(tmp_path, cluster={field: value})
        assert (other.cluster.nodes, other.cluster.gpus_per_node) == (base.cluster.nodes, base.cluster.gpus_per_node)
        assert cluster_key(other) != cluster_key(base), field
        assert key(other) != key(base), field
        # Why it must: the same layout is priced differently on the other fabric.
        priced = Estimator.for_config(other), Estimator.for_config(base)
        assert any(priced[0](lo).step_terms != priced[1](lo).step_terms for lo in layouts), field


def test_fields_left_out_of_the_key_move_no_prediction(tmp_path: Path) -> None:
    """What the key leaves out is what no prediction reads: a calibration learnt over one address or with warm ranks
    prices the same cluster reached another way. Fails when the estimator starts reading one of them."""
    base = _config(tmp_path)
    changed = {"address": "local", "simulate": False, "connect_timeout_s": 99.0, "warm_ranks": True,
               "host_memory_gib": 512.0}
    assert set(changed) == CLUSTER_FIELDS_NOT_PRICED
    expected = _predictions(base)
    for field, value in changed.items():
        other = _config(tmp_path, cluster={field: value})
        assert key(other) == key(base), field
        assert _predictions(other) == expected, field
    published = {name: 123.0 for name in MODEL_FIELDS_NOT_PRICED}
    other = _config(tmp_path, model={"preset": "tiny-moe", **published})
    assert key(other) == key(base) and _predictions(other) == expected


def test_an_entry_under_the_key_of_before_is_not_read(tmp_path: Path) -> None:
    """The key of before named the model and the cluster's shape only: an entry stored under it may be another
    model's or another fabric's, so it is not found (the sweep starts uncalibrated), never read as this one's."""
    cfg = _config(tmp_path)
    before = re.sub(r"-(fig|spec)[0-9a-f]{8}", "", key(cfg))
    assert before != key(cfg) and "-fig" not in before and "-spec" not in before
    save(cache_path(), before, Calibration(step_time_factor=3.0, samples=5))
    assert stored(cfg) == (None, None)


def _no_locks(calls: list[int]) -> Any:
    """A stand-in of the filesystem: ``flock`` as an NFS mount without a lock daemon answers it."""
    def flock(fd: Any, operation: int) -> None:
        calls.append(operation)
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    return flock


@pytest.mark.parametrize("host_cores", [None, 2], ids=["gpus", "simulated"])
def test_a_cache_without_file_locks_costs_the_sharing_not_the_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_cores: int | None) -> None:
    calls: list[int] = []
    monkeypatch.setattr(calibration_module.fcntl, "flock", _no_locks(calls))  # stand-in of the filesystem
    cfg = _config(tmp_path)
    calibrator = Calibrator(cfg, tmp_path / "sweep", host_cores=host_cores)
    lo = Layout(world_size=2, gbs=8)
    measured = Measured(passed=True, step_time_s=0.5, peak_memory_gib=1.5, peak_on_device=host_cores is None)
    update = calibrator.add(lo, measured, 1)
    assert update.warning is not None and "not shared" in update.warning and str(cache_path()) in update.warning
    assert calls and not cache_path().exists()  # nothing written without the lock
    own = load(tmp_path / "sweep" / "calibration.json", key(cfg, host_cores))
    assert own is not None and own.samples == 1  # the sweep keeps its factors in its own folder
    update = calibrator.add(Layout(world_size=2, tp=2, sp=True, gbs=8), measured, 2)
    assert update.warning is None and len(calls) == 1  # said once; the cache is not tried again
    own = load(tmp_path / "sweep" / "calibration.json", key(cfg, host_cores))
    assert own is not None and own.samples == 2


def test_save_stores_nothing_without_a_lock_and_raises_on_other_lock_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "calibration.json"
    monkeypatch.setattr(calibration_module.fcntl, "flock", _no_locks([]))  # stand-in of the filesystem
    assert save(path, "cluster/model", Calibration(samples=1)) is False and not path.exists()
    assert save(path, "cluster/model", Calibration(samples=1), shared=False) is True
    assert load(path, "cluster/model") == Calibration(samples=1)

    def broken(fd: Any, operation: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(calibration_module.fcntl, "flock", broken)
    with pytest.raises(OSError, match="Input/output"):
        save(path, "cluster/other", Calibration(samples=2))
