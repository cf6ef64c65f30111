"""The package layout as a contract: sweeper/ holds only the entry points and the packages of the data flow; no
module takes part in an import cycle (function-local and TYPE_CHECKING imports included); and import-linter's
contracts in pyproject.toml (packages layered along the data flow, megatron / ray / mlflow / optuna each imported
in one place) hold."""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL_MODULES = {"__init__.py", "__main__.py", "cli.py", "errors.py"}
PACKAGES = {"config", "models", "space", "plan", "estimate", "record", "backends", "cluster", "trial", "report", "export",
            "search", "ui"}


def test_top_level_holds_only_entry_points_and_packages() -> None:
    package = ROOT / "sweeper"
    modules = {p.name for p in package.glob("*.py")}
    packages = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert modules == TOP_LEVEL_MODULES
    assert packages == PACKAGES


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                child = edges[node][i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_no_module_is_in_an_import_cycle() -> None:
    graph = grimp.build_graph("sweeper", exclude_type_checking_imports=False, cache_dir=None)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for module in ("p.a", "p.b", "p.c"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_import_linter_contracts_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # lint-imports reads pyproject.toml from the working directory
    assert lint_imports(no_cache=True) == 0
