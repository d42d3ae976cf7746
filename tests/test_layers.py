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


def imported_roots(module: ast.Module) -> set[str]:
    roots = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_downwards(layer: str, parse_module) -> None:
    imports = {str(p.relative_to(ROOT)): imported_roots(parse_module(p)) for p in (ROOT / layer).rglob("*.py")}
    bad = {path: sorted(roots & FORBIDDEN[layer]) for path, roots in imports.items() if roots & FORBIDDEN[layer]}
    assert not bad, f"{layer}/ imports a layer above it: {bad}"


def test_a_finalizer_that_parses_during_the_parse_cannot_break_the_layer_check(parse_module) -> None:
    """Cyclic garbage whose finalizer parses, as asyncio's log of an unretrieved Dask task does (see conftest)."""

    class ParsesWhenCollected:
        def __del__(self) -> None:
            ast.parse("x = f(y)")

    for _ in range(200):
        garbage = ParsesWhenCollected()
        garbage.cycle = garbage
    del garbage
    assert imported_roots(parse_module(ROOT / "flexmarl" / "orchestrator" / "scheduler.py"))
