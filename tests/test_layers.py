"""Imports go one way: flows -> tasks -> flexmarl -> storage. flexmarl never imports Prefect."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "storage": {"flexmarl", "tasks", "flows", "prefect", "prefect_dask", "torch", "distributed"},
    "flexmarl": {"tasks", "flows", "prefect", "prefect_dask"},
    "tasks": {"flows"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_downwards(layer: str) -> None:
    bad = {
        str(p.relative_to(ROOT)): sorted(imported_roots(p) & FORBIDDEN[layer])
        for p in (ROOT / layer).rglob("*.py")
        if imported_roots(p) & FORBIDDEN[layer]
    }
    assert not bad, f"{layer}/ imports a layer above it: {bad}"
