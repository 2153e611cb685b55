"""The reference table's concerns declare the state they use (tensorhub/core/table/state.py):
every record is set up in ``TableState.__init__``, no concern adds one of its own, and each
concern's docstring names exactly the records it touches."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tensorhub.core.table import ReferenceTable
from tensorhub.core.table.state import TableState

TABLE = Path(__file__).resolve().parent.parent / "tensorhub" / "core" / "table"


def _self_attrs(node: ast.AST, assigned_only: bool = False) -> list[str]:
    found: list[str] = []
    for sub in ast.walk(node):
        if not (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
            continue
        if assigned_only and not isinstance(sub.ctx, ast.Store):
            continue
        if sub.attr not in found:
            found.append(sub.attr)
    return found


def _state() -> list[str]:
    tree = ast.parse((TABLE / "state.py").read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return _self_attrs(init, assigned_only=True)


def _concerns() -> list[tuple[str, ast.ClassDef]]:
    out = []
    for path in sorted(TABLE.glob("*.py")):
        if path.name == "__init__.py":  # the table itself, which combines them
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id == "TableState" for b in node.bases
            ):
                out.append((path.name, node))
    return out


def test_every_concern_is_a_table_state_and_the_table_has_them_all():
    concerns = _concerns()
    names = {node.name for _, node in concerns}
    assert len(concerns) >= 14, names
    bases = {cls.__name__ for cls in ReferenceTable.__mro__}
    assert names <= bases, names - bases
    assert ReferenceTable.__mro__[-2] is TableState  # the state's own class comes last, before object


def test_no_concern_adds_state_of_its_own():
    state = set(_state())
    assert {"models", "sessions", "grants", "clock"} <= state
    extra = {
        f"{module}:{node.name}.{attr}"
        for module, node in _concerns()
        for attr in _self_attrs(node, assigned_only=True)
        if attr not in state
    }
    assert extra == set(), "set it up in TableState.__init__ (tensorhub/core/table/state.py)"


def test_each_concern_names_the_records_it_uses():
    state = _state()
    wrong = []
    for module, node in _concerns():
        used = sorted(a for a in _self_attrs(node) if a in state)
        doc = " ".join((ast.get_docstring(node) or "").split())
        listed = re.search(r"State \(:class:`~tensorhub\.core\.table\.state\.TableState`\): (.*?)\.$", doc)
        named = sorted(re.findall(r"``(\w+)``", listed.group(1))) if listed else None
        if named != used:
            wrong.append(f"{module}:{node.name}: docstring says {named}, uses {used}")
    assert wrong == []
