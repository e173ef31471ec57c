"""One `decide_flow()` (shared/flow_decision.py) makes the gateway's network decisions: the sandbox-state
snapshot and the pure decide() are written out once, for the explicit proxy, the transparent listener and
raw TCP in tunnels (issue 25; they were three copies that had drifted apart).

decide() itself may also be called, on state the caller already has, by approval_gate.py (the same
decision again with the sandbox's live grants, inside decide_flow's settle step) and by the MCP route
(mcp/answer.py: would a POST to an announced message endpoint be allowed, judged on the flow's own
recorded snapshot). Plain and fast: the source is parsed, nothing is imported.
"""

from __future__ import annotations

import ast

from tests.architecture.imports import PACKAGE, modules, tree

FLOW_DECISION = f"{PACKAGE}.shared.flow_decision"
# the byte ledger reads a snapshot for the bytes a sandbox has left (the 429 figure), not to decide
SNAPSHOT_NOT_FOR_A_DECISION = {f"{PACKAGE}.shared.ledger"}
DECIDE_ON_KNOWN_STATE = {f"{PACKAGE}.shared.approval_gate", f"{PACKAGE}.mcp.answer"}


def calls(module: ast.Module, name: str) -> list[int]:
    """Lines calling `name(...)` or `<anything>.name(...)`."""
    return [
        node.lineno
        for node in ast.walk(module)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == name)
            or (isinstance(node.func, ast.Attribute) and node.func.attr == name)
        )
    ]


def test_the_check_finds_both_call_shapes() -> None:
    """Positive control."""
    source = ast.parse("async def f(rt):\n    decide(p, f, s, 0)\n    await rt.state.snapshot('x')\n")
    assert calls(source, "decide") == [2] and calls(source, "snapshot") == [3]


def test_only_decide_flow_takes_a_snapshot_for_a_decision() -> None:
    takers = {name: lines for name in modules() if (lines := calls(tree(name), "snapshot"))}
    assert set(takers) - SNAPSHOT_NOT_FOR_A_DECISION == {FLOW_DECISION}, takers


def test_decide_is_called_by_decide_flow_and_on_known_state_only() -> None:
    callers = {name for name in modules() if calls(tree(name), "decide")}
    assert FLOW_DECISION in callers
    assert callers - {FLOW_DECISION} <= DECIDE_ON_KNOWN_STATE, callers - {FLOW_DECISION} - DECIDE_ON_KNOWN_STATE


def test_the_explicit_proxy_transparent_listener_and_tunnels_use_it() -> None:
    users = {
        name.removeprefix(PACKAGE + ".")
        for name in modules()
        if name != FLOW_DECISION and calls(tree(name), "decide_flow")
    }
    assert {"pipeline.decision", "shared.transparent_decide", "layers.next_layer"} <= users, users
