"""Every field of a unit that says where its bytes are has one writer: `stale`, `update` and `has_grad` are written
only inside offload/zero/units/unit.py, the other files call its transitions (on_shard_written, on_update_queued,
on_gradient_loaded), as its `state` is written only by `_transition`. Read from the source with ast."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "offload"
UNIT = PACKAGE / "zero" / "units" / "unit.py"
FIELDS = ("stale", "update", "has_grad")


def _writes(source: str) -> list[tuple[int, str]]:
    """(line, field) of every assignment to an attribute named in FIELDS, tuple targets included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and t.attr in FIELDS and isinstance(t.ctx, ast.Store):
                    found.append((node.lineno, t.attr))
    return found


def test_a_units_fields_are_written_only_by_the_unit():
    outside = [f"{path.relative_to(PACKAGE.parent)}:{line}: .{field} =" for path in sorted(PACKAGE.rglob("*.py"))
               if path != UNIT for line, field in _writes(path.read_text())]
    assert not outside, "call the unit's transition instead: " + "; ".join(outside)


def test_the_reader_finds_plain_and_tuple_writes():
    code = "u.stale = True\nu.has_grad, u.local_grad = False, None\nu.update: object = f\nu.stale == True\n"
    assert _writes(code) == [(1, "stale"), (2, "has_grad"), (3, "update")]
