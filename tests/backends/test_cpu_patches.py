"""The CPU stand-ins' patches (sweeper/backends/megatron/cpu/patches.py) against the installed megatron-core: each
patched symbol is still where the table says, with the signature it was written against, in a version it was
written for; and every patch the stand-ins apply is in the table. A new megatron-core release is then a list of
failing rows here. Megatron's originals are read in a fresh interpreter before any stand-in is installed (an
install in this process, by another test, would show sweeper's replacements instead)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet

from sweeper.backends.megatron.cpu.patches import CHECKED, PATCHES, SUPPORTED, Patch

_PROBE = r"""
import importlib, importlib.metadata, importlib.util, inspect, json, sys, types, unittest.mock
import warnings
warnings.simplefilter("ignore")

targets = json.loads(sys.argv[1])


def plain(obj):
    sig = inspect.signature(obj)
    empty = inspect.Parameter.empty
    return str(sig.replace(parameters=[p.replace(annotation=empty) for p in sig.parameters.values()],
                           return_annotation=inspect.Signature.empty))


def resolve(target):
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ImportError:
            continue
        owner = name
        for part in parts[i:]:
            if not hasattr(obj, part):
                return {"found": False, "owner": owner, "signature": None}
            obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
            owner = owner + "." + part
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        callable_ = callable(obj) and not isinstance(obj, (unittest.mock.Mock, types.ModuleType))
        return {"found": True, "owner": owner, "signature": plain(obj) if callable_ else None}
    return {"found": False, "owner": None, "signature": None}


from sweeper.backends.megatron.cpu import mamba

originals = {}
# A module among the targets (Triton's tensor ops) is itself a stand-in's: looked for before the stand-in goes in.
for t in targets:
    try:
        found = importlib.util.find_spec(t)
    except Exception:  # not a module: its parent is no package (or does not import before the stand-ins)
        continue
    if found is not None:
        originals[t] = {"found": True, "owner": t, "signature": None}
mamba._provide_tensor_ops_without_triton()  # megatron.core.ssm imports them at module level
for t in targets:
    originals.setdefault(t, resolve(t))

import dataclasses
from types import SimpleNamespace

from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

from sweeper.backends.megatron.cpu import compat, patches, spec

compat.install()
mamba.install()
mamba.local_mamba_stack_spec()
for config in (SimpleNamespace(num_moe_experts=4, multi_latent_attention=True, context_parallel_size=1,
                               sequence_parallel=True),
               SimpleNamespace(num_moe_experts=None, multi_latent_attention=False, context_parallel_size=2,
                               sequence_parallel=False)):
    # Every field given: from megatron-core 0.17 some have no default.
    submodules = MLASelfAttentionSubmodules(**{f.name: None for f in dataclasses.fields(MLASelfAttentionSubmodules)})
    spec.adapt_local_block_spec([submodules], config)


def overrides(cls):
    # Methods a class defines that a megatron-core base class defines too: each is a patch of that base's method.
    out = []
    for name, value in vars(cls).items():
        if not callable(value) and not isinstance(value, (staticmethod, classmethod)):
            continue
        for base in cls.__mro__[1:]:
            if base.__module__.startswith("megatron.") and name in vars(base):
                out.append(f"{base.__module__}.{base.__qualname__}.{name}")
                break
    return out


applied = sorted(t for t in patches.applied if t.startswith("megatron."))
classes = [v for v in patches.applied.values() if isinstance(v, type)]
for module in ("attention", "compat", "experts", "linear", "mamba", "norm", "spec"):
    mod = importlib.import_module(f"sweeper.backends.megatron.cpu.{module}")
    classes += [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == mod.__name__]
overridden = sorted({t: None for cls in classes for t in overrides(cls)})
print(json.dumps({"version": importlib.metadata.version("megatron-core"), "originals": originals,
                  "applied": applied, "overridden": overridden}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    targets = json.dumps([p.target for p in PATCHES])
    out = subprocess.run([sys.executable, "-c", _PROBE, targets], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_installed_megatron_core_is_in_the_range_the_table_was_written_for(probe):
    assert probe["version"] in SpecifierSet(SUPPORTED), \
        f"megatron-core {probe['version']} is installed; cpu/patches.py was checked against {', '.join(CHECKED)} " \
        f"and is written for {SUPPORTED}: check every row against it, then widen SUPPORTED and pyproject's pin"


@pytest.mark.parametrize("patch", PATCHES, ids=[p.target.removeprefix("megatron.core.") for p in PATCHES])
def test_patched_symbol_is_where_and_what_it_was_written_for(patch: Patch, probe):
    release = probe["version"]
    original = probe["originals"][patch.target]
    where = f"{patch.target} (patched by cpu/{patch.by})"
    if not patch.applies(release):
        # A defect megatron-core fixed: the stand-in must have seen the fix and left the symbol alone.
        assert patch.target not in probe["applied"], \
            f"{where} applies to megatron-core {patch.versions}, yet was patched on {release}"
        return
    if patch.defined_on(release):
        assert original["found"], f"{where} is gone from megatron-core {release} (found up to " \
                                  f"{original['owner']}): find where it moved and update the patch and its row"
    else:
        assert original["owner"] == patch.target.rsplit(".", 1)[0], \
            f"{where}: its module is gone from megatron-core {release} (found up to {original['owner']})"
        assert not original["found"], f"{where}: megatron-core {release} now defines it: the patch may go"
    try:
        expected = patch.signature_on(release)
    except LookupError as missing:
        pytest.fail(f"{missing}: check the patch against it and add the release's signature to its row")
    assert expected is None or original["signature"] == expected, \
        f"{where} changed signature in megatron-core {release}:\n  written for {expected}\n" \
        f"  installed   {original['signature']}"


def test_every_applied_patch_is_in_the_table(probe):
    declared = {p.target for p in PATCHES}
    undeclared = sorted(set(probe["applied"]) - declared)
    assert not undeclared, f"patched but not in cpu/patches.py: {undeclared}"
    assert probe["applied"], "the stand-ins patched nothing: is the recording broken?"


def test_every_overridden_megatron_method_is_in_the_table(probe):
    declared = {p.target for p in PATCHES}
    undeclared = sorted(set(probe["overridden"]) - declared)
    assert not undeclared, f"megatron-core methods a stand-in overrides, not in cpu/patches.py: {undeclared}"


def test_each_target_is_declared_once():
    targets = [p.target for p in PATCHES]
    assert len(targets) == len(set(targets)), sorted(t for t in targets if targets.count(t) > 1)
