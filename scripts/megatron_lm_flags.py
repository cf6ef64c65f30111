"""Write the command-line flags Megatron-LM's ``pretrain_gpt.py`` / ``pretrain_mamba.py`` accept, one per line.

    python scripts/megatron_lm_flags.py MEGATRON_LM_CHECKOUT > tests/data/megatron_lm_flags.txt

The checkout is Megatron-LM at the tag matching the installed megatron-core (``core_v0.16.1`` for 0.16.1); from
0.17 the megatron-core wheel ships ``megatron/training`` itself, so its site-packages folder serves
(``tests/data/megatron_lm_flags_0.19.txt``: megatron-core 0.19.2's, whose config dataclasses sit in
``megatron/training/config/``). Its ``megatron/training/arguments.py`` adds flags in two ways, and both are read
here without importing it (it needs the whole training stack):
  - ``add_argument('--flag', ...)`` calls: every ``--`` string literal in them;
  - ``ArgumentGroupFactory(SomeConfig, exclude=[...])`` groups: the dataclass's fields turned into flags by
    Megatron-LM's own ``argument_utils.ArgumentGroupFactory`` (loaded from the checkout: it imports the standard
    library only), on a scratch parser. ``SomeConfig`` is megatron-core's ``TransformerConfig`` (installed) or a
    dataclass of ``megatron/training/*_config.py`` (loaded from the checkout: standard library only too).
The exclude lists are read from the call (a list literal, or a name bound to one in the same function).
``tests/data/megatron_lm_flags.txt`` is the list the exports' tests check ``launch_megatron_lm.sh`` against.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType

CONFIG_FILES = ("training_config.py", "common_config.py", "resilience_config.py")


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


def _literal_flags(tree: ast.AST) -> set[str]:
    flags = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                      and a.value.startswith("--")}
    return flags


def _factory_calls(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(config class name, excluded field names) of every ArgumentGroupFactory call."""
    calls = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        bound = {t.id: n.value for n in ast.walk(func) if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(func):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "ArgumentGroupFactory"):
                continue
            cls = node.args[0]
            assert isinstance(cls, ast.Name), ast.dump(cls)
            exclude: list[str] = []
            for kw in node.keywords:
                if kw.arg == "exclude":
                    value = bound[kw.value.id] if isinstance(kw.value, ast.Name) else kw.value
                    exclude = ast.literal_eval(value)
            calls.append((cls.id, exclude))
    return calls


def flags(checkout: Path) -> list[str]:
    training = checkout / "megatron" / "training"
    tree = ast.parse((training / "arguments.py").read_text())
    factory = _load(training / "argument_utils.py", "_mlm_argument_utils").ArgumentGroupFactory
    classes = {}
    for name in CONFIG_FILES:
        path = training / name if (training / name).exists() else training / "config" / name  # 0.19: config/
        module = _load(path, f"_mlm_{name[:-3]}")
        classes.update({k: v for k, v in vars(module).items() if isinstance(v, type)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's notes about missing Transformer Engine / Apex
        from megatron.core.transformer import TransformerConfig
    classes["TransformerConfig"] = TransformerConfig
    parser = argparse.ArgumentParser(add_help=False)
    for cls_name, exclude in _factory_calls(tree):
        factory(classes[cls_name], exclude=exclude).build_group(parser)
    generated = {s for action in parser._actions for s in action.option_strings}  # noqa: SLF001 - argparse's list
    return sorted(generated | _literal_flags(tree))


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("checkout", type=Path)
    args = cli.parse_args()
    sys.stdout.write("".join(f"{flag}\n" for flag in flags(args.checkout)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
