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


# --- the layer table (docs/architecture.md) -----------------------------------------------------------
#: Every module's layer; a module may import its own layer's package or any lower layer, never a higher
#: one, and never sideways between blob/, jobs/ and checkpoint/ (lazy and type-only imports count).
CORE = {"errors", "enums", "config", "ids", "clock", "owner", "storage", "wire", "shim_protocol", "hashing", "tables",
        "progress", "rendezvous", "worker", "libraries", "lazy"}
API = {"client", "session", "jobscope", "keyed_state", "keyed_figures", "keyed_idle", "keyed_spark", "keyed_tasks",
       "routing", "jar", "daemon", "cli", "ops", "windows", "state_source", "state_writer", "state_cli", "connect",
       "keyed_options", "__init__", "__main__"}
LAYERS = {"core": 0, "state": 1, "checkpoint": 2, "blob": 2, "jobs": 2, "api": 3, "agents": 4}


def _layer_of(module: str) -> str:
    """The layer of ``sparksteward.<...>``: its package, or core/api for top-level modules. A feature's
    ``cli`` module is an entry point: the api layer."""
    parts = module.split(".")[1:] or ["__init__"]
    if parts[0] in ("state", "checkpoint", "blob", "jobs", "agents", "testing"):
        return "api" if parts[1:2] == ["cli"] else parts[0]
    if parts[0] in CORE:
        return "core"
    if parts[0] in API:
        return "api"
    raise AssertionError(f"module {module} is in no layer: add it to CORE or API in tests/test_dependencies.py")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _all_imports(path: Path) -> set[str]:
    """Every sparksteward module ``path`` imports, relative imports resolved (``from x import y`` also
    counts ``x.y``, which may be a module)."""
    me = _module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    known = {_module_name(p) for p in ROOT.rglob("*.py")}
    return {n for n in names if n in known}


def test_every_import_goes_down_the_layers():
    offenders = []
    for path in ROOT.rglob("*.py"):
        mine = _module_name(path)
        src = _layer_of(mine)
        if src == "testing":
            continue
        for target in sorted(_all_imports(path)):
            dst = _layer_of(target)
            if dst == src:
                continue
            if dst == "testing" or dst == "agents" or LAYERS[dst] > LAYERS[src] or \
                    (LAYERS[dst] == LAYERS[src] and dst != src):
                offenders.append(f"{mine} ({src}) imports {target} ({dst})")
    assert offenders == []


def test_no_import_cycle_between_modules():
    """Static imports between production modules form no cycle (the layers alone allow one inside a package)."""
    graph = {_module_name(p): _all_imports(p) - {_module_name(p)} for p in ROOT.rglob("*.py")
             if "testing" not in p.relative_to(ROOT).parts}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == "sparksteward" or nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


# --- one idea per module ----------------------------------------------------------------------------
#: Production modules allowed past MAX_LINES, each named with its reason in docs/decisions/ (0025).
LONG_MODULES = {"config.py"}
MAX_LINES = 600


def test_no_production_module_is_over_600_lines_except_the_named_ones():
    long = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")
            if "testing" not in p.relative_to(ROOT).parts}
    over = {k: n for k, n in long.items() if n > MAX_LINES and k not in LONG_MODULES}
    assert over == {}, f"split these modules (one idea each) or name them in LONG_MODULES and docs/decisions/: {over}"
    decisions = " ".join(p.read_text() for p in (ROOT.parent.parent / "docs" / "decisions").glob("*.md"))
    assert all(f"`{name}`" in decisions for name in LONG_MODULES)
