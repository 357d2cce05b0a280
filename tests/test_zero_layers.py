"""offload/ in layers: no import cycle among its files, and nothing in offload/zero/units/ (a unit and its bytes)
imports what stands above it (the optimizers and the step, placement, the schedule, the runtime). Read from the
source with ast: every import counts, those inside functions and under TYPE_CHECKING too, and a package's
__init__.py is a file like the others (importing a package runs it)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "offload"
ABOVE_UNITS = ("update.", "placement", "schedule", "runtime", "wrap", "torch_patches", "checkpoint", "grad_scaler")


def _modules() -> dict[str, Path]:
    """'offload.zero.units.unit' -> its path, for every file of offload/ (a package by its own name)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("offload",) + path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The files of offload/ that `name` imports, relative or absolute: `from P import m` imports the module P.m
    where there is one, and the package P (its __init__.py) for any name that is not a module."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = ".".join(package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else []))
        else:
            base = node.module or ""
        submodules = {f"{base}.{a.name}" for a in node.names} & modules.keys()
        found |= submodules
        if base in modules and len(submodules) < len(node.names):
            found.add(base)
    found.discard(name)
    return found


def _graph(prefix: str = "offload") -> dict[str, set[str]]:
    """The import arrows among the files under `prefix` (a dotted package name)."""
    modules = _modules()
    inside = {name for name in modules if name == prefix or name.startswith(prefix + ".")}
    return {name: _imports(name, modules[name], modules) & inside for name in inside}


def _first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for target in sorted(graph[node]):
            cycle = visit(target, path + [node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node, [])
        if cycle:
            return cycle
    return None


def test_no_import_cycle_in_the_package():
    cycle = _first_cycle(_graph())
    assert cycle is None, "offload/ import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert _first_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _first_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_imports_are_read_as_python_resolves_them():
    graph = _graph()
    assert "offload.optim.adamw" in graph["offload.optim"]  # from .adamw import AdamW (the package's own module)
    assert "offload.store" in graph["offload.zero.runtime"]  # from ..store import Tier (a name of the package)
    assert "offload.zero.units.hooks" in graph["offload.zero.wrap"]  # from .units import hooks (a module)


def test_zero_folders_stand_in_layers():
    """A folder of zero/ (units/, update/, collectives/) is one layer: with each folder taken as one node, the files
    and folders of zero/ still import each other in no cycle, so no arrow runs back up between them (the package's
    own __init__.py, its face, left out)."""
    def node(name: str) -> str:
        return name.removeprefix("offload.zero.").split(".")[0]

    rooms: dict[str, set[str]] = {}
    for name, targets in _graph("offload.zero").items():
        if name != "offload.zero":
            rooms.setdefault(node(name), set()).update(node(t) for t in targets if t != "offload.zero")
    for room, targets in rooms.items():
        targets.discard(room)
    cycle = _first_cycle(rooms)
    assert cycle is None, "offload/zero/ layers import each other: " + " -> ".join(cycle)


def test_units_import_nothing_above_them():
    zero = {name.removeprefix("offload.zero."): {t.removeprefix("offload.zero.") for t in targets}
            for name, targets in _graph("offload.zero").items()}
    upward = sorted(f"{name} -> {target}" for name, targets in zero.items()
                    if name.startswith("units.") for target in targets if target.startswith(ABOVE_UNITS))
    assert not upward, upward
