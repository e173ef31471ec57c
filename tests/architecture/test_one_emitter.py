"""One module of the gateway hands records to the audit sink (issue 25): emit.py. Every other gateway file
asks it (emit.write / write_after / write_behind), so how a record reaches the trail — durable before an
effect, or queued and retried, never dropped — is decided in one place. Building a record stays in
audit/build.py (tests/audit/test_build.py). And a prepayment is refunded by one function in one module.

Plain and fast: the source is parsed, nothing is imported.
"""

from __future__ import annotations

import ast

from tests.architecture.imports import PACKAGE, modules, tree

EMITTER = f"{PACKAGE}.shared.emit"
SINK_WRITES = {"write", "write_after", "enqueue_after"}  # audit/sink.py: AuditSink's ways in
SINK_ONLY = {"write_after", "enqueue_after"}  # names no other object of ours has: flagged on any receiver


def sink_calls(module: ast.Module) -> list[str]:
    """`….audit.write(…)`, `….audit.write_after(…)`, `….audit.enqueue_after(…)` and any `….write_after(…)` /
    `….enqueue_after(…)` call, as source text."""
    found = []
    for node in ast.walk(module):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        method, receiver = node.func.attr, node.func.value
        via_audit = (isinstance(receiver, ast.Attribute) and receiver.attr == "audit") or (
            isinstance(receiver, ast.Name) and receiver.id == "audit"
        )
        asks_emit = isinstance(receiver, ast.Name) and receiver.id == "emit"  # emit.write_after(rt, …)
        if not asks_emit and (method in SINK_ONLY or (method in SINK_WRITES and via_audit)):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}(…)")
    return found


def test_the_check_finds_direct_sink_calls() -> None:
    """Positive control: each way a file could write to the sink itself is found (and an unrelated
    `write` is not)."""
    source = ast.parse(
        "async def f(rt, self, audit, fh):\n"
        "    await rt.audit.write(e)\n"
        "    await self.rt.audit.write_after(e)\n"
        "    rt.audit.enqueue_after(e)\n"
        "    audit.write(e)\n"
        "    sink.enqueue_after(e)\n"
        "    fh.write(b'x')\n"
        "    await emit.write_after(rt, e)\n"
    )
    assert len(sink_calls(source)) == 5


def test_only_emit_py_writes_to_the_sink() -> None:
    assert EMITTER in modules()
    offenders = {name: calls for name in modules() if name != EMITTER and (calls := sink_calls(tree(name)))}
    assert not offenders, f"gateway modules writing to the audit sink themselves (use emit.py): {offenders}"
    assert sink_calls(tree(EMITTER)), "emit.py no longer writes to the sink: the check would be vacuous"


def test_refund_prepaid_is_defined_once_in_the_shared_counters() -> None:
    where = [
        name
        for name in modules()
        for node in ast.walk(tree(name))
        if isinstance(node, ast.FunctionDef) and node.name == "refund_prepaid"
    ]
    assert where == [f"{PACKAGE}.shared.counters"], where
