"""Write the fields of the Megatron-Bridge dataclasses sweeper's override file lands on, for one Bridge release (JSON).

    python scripts/megatron_bridge_fields.py BRIDGE_WHEEL_DIR [MEGATRON_LM_DIR] > fields.json

BRIDGE_WHEEL_DIR is an unzipped ``megatron_bridge-X-py3-none-any.whl`` (``pip download megatron-bridge==X --no-deps``,
then unzip: Bridge is not installed, it needs Transformer Engine and a GPU). From Bridge 0.4 TrainingConfig and
CheckpointConfig extend ``megatron.training.config``'s, which ship in megatron-core: MEGATRON_LM_DIR is Megatron-LM at
the commit that release pins as its ``3rdparty/Megatron-LM`` submodule, and their inherited fields are read there.
Also written: the mixed-precision recipe names (``@register`` in mixed_precision.py) and the pretraining recipes
each ``megatron/bridge/recipes/<family>/__init__.py`` exports. Everything is read from the source (ast), nothing is
imported. ``tests/data/megatron_bridge_fields.json`` holds one
such object per release; the exports' tests check ``megatron_bridge_overrides.yaml`` against it.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

# (class, file under megatron/bridge/training/)
CLASSES = (
    ("ConfigContainer", "config.py"),
    ("TrainingConfig", "config.py"),
    ("CheckpointConfig", "config.py"),
    ("MixedPrecisionConfig", "mixed_precision.py"),
    ("CommOverlapConfig", "comm_overlap.py"),
)
# What Bridge's config.py imports its bases as (0.4 on) -> (class, file under megatron/training/config/)
MTRAIN = {"MTrainTrainingConfig": ("TrainingConfig", "training_config.py"),
          "MTrainCheckpointConfig": ("CheckpointConfig", "training_config.py")}


def _class(path: Path, name: str) -> ast.ClassDef:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise SystemExit(f"{path}: no class {name}")


def _fields(node: ast.ClassDef) -> list[str]:
    """The dataclass fields a class declares (annotated names; ClassVar and private ones left out)."""
    out = []
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            if "ClassVar" in ast.unparse(item.annotation) or item.target.id.startswith("_"):
                continue
            out.append(item.target.id)
    return out


def _registered(path: Path) -> list[str]:
    """The mixed-precision recipe names: functions decorated ``@register`` (mixed_precision.py)."""
    return sorted(node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)
                  and any(ast.unparse(d) == "register" for d in node.decorator_list))


def _pretrain_recipes(recipes: Path) -> list[str]:
    """``megatron.bridge.recipes.<family>.<name>`` for every ``*_pretrain_config`` a family package exports."""
    out = []
    for init in sorted(recipes.glob("*/__init__.py")):
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    name = alias.asname or alias.name
                    if name.endswith("_pretrain_config"):
                        out.append(f"megatron.bridge.recipes.{init.parent.name}.{name}")
    return sorted(set(out))


def main(wheel: Path, megatron_lm: Path | None) -> dict[str, list[str]]:
    training = wheel / "megatron" / "bridge" / "training"
    out: dict[str, list[str]] = {"mixed_precision_recipes": _registered(training / "mixed_precision.py"),
                                 "pretrain_recipes": _pretrain_recipes(wheel / "megatron" / "bridge" / "recipes")}
    for name, file in CLASSES:
        node = _class(training / file, name)
        names = _fields(node)
        for base in (ast.unparse(b) for b in node.bases):
            if base in MTRAIN:
                if megatron_lm is None:
                    raise SystemExit(f"{name} extends megatron.training's {base}: give MEGATRON_LM_DIR")
                base_name, base_file = MTRAIN[base]
                names = _fields(_class(megatron_lm / "megatron" / "training" / "config" / base_file, base_name)) + names
        out[name] = sorted(set(names))
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    json.dump(main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else None), sys.stdout, indent=1)
    print()
