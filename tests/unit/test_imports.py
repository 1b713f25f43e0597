"""The import graph: the dependency rule holds (`lint-imports` over the contracts in
pyproject.toml) and no modules import each other in a circle.

A circle says two modules are one room, or that a name lives in the wrong one. The only
circles allowed are the catalogs' registration: each policy or router module registers itself
in the registry that imports the catalog (`policies/catalog/*` with `policies/registry.py`,
`policies/routing/catalog/*` with `policies/routing/registry.py`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("policies", "predictor", "gateway", "loadgen")
REGISTRATION = ("policies.catalog", "policies.routing.catalog")
"""Packages whose modules may sit in a circle with their registry."""


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def registration_only(component: list[str]) -> bool:
    """A circle made of one catalog package, its modules and its registry."""
    for catalog in REGISTRATION:
        registry = catalog.rsplit(".", 1)[0] + ".registry"
        if all(m in (registry, catalog) or m.startswith(catalog + ".") for m in component):
            return True
    return False


def test_no_import_circles() -> None:
    graph = grimp.build_graph(*PACKAGES)
    bad = [c for c in circles(graph) if not registration_only(c)]
    assert not bad, bad


def test_the_circle_finder_finds_circles() -> None:
    graph = grimp.ImportGraph()
    for m in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(m)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert circles(graph) == [["a.x", "a.y"]]
    assert registration_only(["policies.catalog.fcfs", "policies.registry"])
    assert not registration_only(["gateway.serving.app", "gateway.serving.security"])


def test_import_contracts() -> None:
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout, proc.stdout[-2000:]
