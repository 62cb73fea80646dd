"""The dependency direction of the architecture, checked on the source: nothing imports ``agents/``,
and no production module imports ``sparksteward.testing`` (the fakes are for tests only)."""

from __future__ import annotations

import ast
from pathlib import Path

import sparksteward

ROOT = Path(sparksteward.__file__).parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(exclude: str) -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if exclude not in p.relative_to(ROOT).parts]


def test_production_code_never_imports_the_testing_package():
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("sparksteward.testing"))
                 for p in _modules("testing")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_nothing_imports_the_agents():
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("sparksteward.agents"))
                 for p in _modules("agents")}
    assert {k: v for k, v in offenders.items() if v} == {}
