"""offload/zero/ in layers: no import cycle among its files, and nothing in units/ (a unit and its bytes) imports
what stands above it (the optimizers and the step, placement, the schedule, the runtime). Read from the source with
ast: every import counts, those inside functions and under TYPE_CHECKING too."""
from __future__ import annotations

import ast
from pathlib import Path

ZERO = Path(__file__).resolve().parent.parent / "offload" / "zero"
ABOVE_UNITS = ("update.", "placement", "schedule", "runtime", "wrap", "torch_patches", "checkpoint", "grad_scaler")


def _modules() -> dict[str, Path]:
    """'units.unit' -> its path, for every file of offload/zero ('' for the package itself)."""
    out = {}
    for path in ZERO.rglob("*.py"):
        parts = path.relative_to(ZERO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The files of offload/zero that `name` imports (relative or absolute), packages' __init__ left out."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            targets = [".".join(base + [a.name]) for a in node.names] + [".".join(base)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            absolute = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            targets = [t.removeprefix("offload.zero.") for t in absolute if t.startswith("offload.zero.")]
        else:
            continue
        for t in targets:
            if t in modules and modules[t].name != "__init__.py" and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycle_in_zero():
    graph = _graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("offload/zero/ import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for target in sorted(graph[node]):
            visit(target, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


def test_units_import_nothing_above_them():
    upward = sorted(f"{name} -> {target}" for name, targets in _graph().items()
                    if name.startswith("units.") for target in targets if target.startswith(ABOVE_UNITS))
    assert not upward, upward
