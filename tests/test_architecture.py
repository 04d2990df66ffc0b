"""The package's layering (docs/architecture.md): every room imports only rooms below it, and no
module imports one that imports it back (imports inside functions included)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[1] / "src"

# room -> the rooms it may import (besides itself); the order of docs/architecture.md
LAYERS = {
    "infra": set(),
    "config": set(),
    "core": set(),
    "models": {"infra", "core"},
    "data": {"infra", "config"},
    "eval": {"infra", "core", "models", "data"},
    "method": {"infra", "config", "core", "models", "data", "eval"},
    "baselines": {"infra", "config", "core", "models", "data", "eval", "method"},
    "run_folder": {"infra", "models", "method"},
    "pipeline": {"infra", "config", "core", "models", "data", "eval", "method", "run_folder"},
    "bench": {"infra", "config", "core", "models", "data", "eval", "method", "baselines"},
    "compare": {"infra", "config", "core", "models", "data", "eval", "method", "baselines", "pipeline"},
    "cli": {
        "infra",
        "config",
        "core",
        "models",
        "data",
        "eval",
        "method",
        "baselines",
        "pipeline",
        "bench",
        "compare",
    },
}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for f in (SRC / "loca").rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _imports(name: str, path: Path, is_pkg: bool, modules: dict) -> set[str]:
    """The loca modules ``name`` imports anywhere in its file (``from pkg import module`` counts as
    importing that module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules and m != name}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, f, pkg, modules) for m, (f, pkg) in modules.items()}


def test_every_room_is_in_the_layer_table():
    rooms = {_room(m) for m in _modules()} - {None}
    assert rooms == set(LAYERS)


def test_rooms_import_only_the_rooms_below_them(graph):
    wrong = [
        f"{m} imports {t}"
        for m, targets in graph.items()
        for t in targets
        if _room(m) and _room(t) and _room(t) != _room(m) and _room(t) not in LAYERS[_room(m)]
    ]
    assert not wrong, "\n".join(wrong)


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in ``edges``, or None."""
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return [*path, m, t]
            if t not in state and (cycle := visit(t, [*path, m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m, [])):
            return cycle
    return None


def test_no_module_imports_one_that_imports_it_back(graph):
    modules = _modules()
    edges = {m: {t for t in ts if not modules[t][1]} for m, ts in graph.items() if not modules[m][1]}
    cycle = _cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_the_checks_see_real_edges_and_an_invented_cycle(graph):
    assert "loca.method.stage2" in graph["loca.method.fit"]
    back = {m: set(ts) for m, ts in graph.items()}
    back["loca.method.stage2"].add("loca.method.fit")  # stage2 importing fit back
    assert _cycle(back) is not None
