"""Per-flow state is typed: one `flow.metadata` key (the FlowState, context.py), no string-keyed bags."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from egressgate.gateway.shared.context import ConnState, FlowState

GATEWAY = Path(__file__).resolve().parents[2] / "egressgate"


def test_only_context_py_touches_flow_metadata() -> None:
    users = []
    for path in GATEWAY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "metadata":
                users.append(path.relative_to(GATEWAY).as_posix())
    assert set(users) == {"gateway/shared/context.py"}, sorted(set(users))


def test_state_has_no_untyped_bags() -> None:
    for cls in (FlowState, ConnState):
        for f in dataclasses.fields(cls):
            annotation = str(f.type)
            assert "Any" not in annotation, (cls.__name__, f.name, annotation)
            assert not annotation.startswith("dict[str, object]"), (cls.__name__, f.name)
    names = {f.name for f in dataclasses.fields(FlowState)}
    assert "extra" not in names and "kind" not in names
