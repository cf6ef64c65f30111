"""The Megatron-Bridge release the export and the HF import follow, and pyproject's bridge extra against the pairing."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from sweeper.config import bridge_release, megatron_release

ROOT = Path(__file__).resolve().parents[2]


def test_each_megatron_core_release_pairs_with_the_bridge_that_pins_it() -> None:
    assert bridge_release.paired(Version("0.16.1")) == Version("0.3.1")
    assert bridge_release.paired(Version("0.17.1")) == Version("0.4.2")
    assert bridge_release.paired(Version("0.18.2")) == Version("0.5.1")
    assert bridge_release.paired(Version("0.19.2")) == Version("0.6.2")
    assert bridge_release.paired(Version("0.15.0")) is None


def test_without_bridge_the_installed_megatron_cores_pair_is_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bridge_release, "installed", lambda: None)
    assert bridge_release.target() == bridge_release.paired(megatron_release.installed())
    assert "not installed here" in bridge_release.describe()
    monkeypatch.setattr(bridge_release, "installed", lambda: Version("0.5.1"))
    assert bridge_release.target() == Version("0.5.1") and bridge_release.describe() == "0.5.1 (installed)"


def test_the_release_facts() -> None:
    assert [bridge_release.fp4_params(Version(v)) for v in ("0.3.1", "0.4.0", "0.6.2")] == [False, True, True]
    assert [bridge_release.refuses_local_layer_graphs(Version(v)) for v in ("0.5.1", "0.6.0")] == [False, True]


def test_the_bridge_extra_pairs_through_the_python_version() -> None:
    """Python 3.11 can only get megatron-core 0.16.x (0.17 needs 3.12), so its Bridge is 0.3.1; 3.12 takes Bridge
    0.4 to 0.6, the pairs of megatron-core 0.17 to 0.19, the range the core dependency allows there."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = [Requirement(r) for r in project["optional-dependencies"]["bridge"]]
    bridges = [r for r in extra if r.name == "megatron-bridge"]
    core = next(Requirement(r) for r in project["dependencies"] if r.startswith("megatron-core"))
    for python, cores in (("3.11", ["0.16"]), ("3.12", ["0.17", "0.18", "0.19"])):
        env = {"python_version": python, "python_full_version": f"{python}.0"}
        (bridge,) = [r for r in bridges if r.marker is None or r.marker.evaluate(env)]
        for minor in cores:
            assert bridge.specifier.contains(bridge_release.PAIRED[minor]), (python, minor)
        assert not bridge.specifier.contains(Version("0.7.0"))  # no pairing read for it yet
    assert all(core.specifier.contains(f"{minor}.0") for minor in bridge_release.PAIRED if minor != "0.16")
    assert core.specifier.contains("0.16.1") and not core.specifier.contains("0.20.0")
