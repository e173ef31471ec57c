"""`audit replay` re-decides MCP tool calls: fully with recorded arguments, at tool level without them.

The records are written the way egressgate/mcp/records.py writes them (same attribute names, OTLP/JSON
lines through audit.record): a session is decided under the OLD policy with the real decide_tool_call,
then replayed under the NEW one.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from click.testing import CliRunner

from egressgate.audit.cli import audit
from egressgate.audit.record import Record, dumps, to_otlp
from egressgate.audit.replay import format_table, replay
from egressgate.policy.loader import load_policy
from egressgate.policy.mcp_decide import McpFacts, ToolCall, decide_tool_call

BASE = """
sandbox: {name: mcp-replay}
network:
  https:
    allow:
      - host: tickets.mcp.test
mcp:
  record_arguments: true
  servers:
    - name: tickets
      url: https://tickets.mcp.test/mcp
      tools:
        allow:
          - name: search_tickets
            budget: {calls: %(budget)d}
            arguments:
              project: {equals_label: tenant, required: true}
              limit: {type: integer, min: 1, max: %(max)d}
%(extra)s
"""
OLD = BASE % {"budget": 10, "max": 50, "extra": "          - name: wide_open\n            unlisted_arguments: allow"}
NEW = BASE % {"budget": 2, "max": 10, "extra": ""}
T0 = 1_700_000_000.0
LABELS = {"tenant": "acme"}


def _record(time_s, decision, *, tool, arguments, record_arguments=True, facts=True, tool_calls=0,
            server_calls=0, reason_override=None):
    attrs = {
        "egressgate.operation": "mcp_tool_call", "egressgate.sandbox.id": "sbx-1",
        "egressgate.sandbox.labels": LABELS, "egressgate.policy.name": "mcp-replay",
        "egressgate.decision": "deny" if reason_override else decision.decision,
        "egressgate.reason": reason_override or str(decision.reason),
        "egressgate.mcp.server": "tickets", "egressgate.mcp.tool": tool, "egressgate.mcp.transport": "streamable_http",
        "egressgate.mcp.arguments_sha256": "0" * 64, "egressgate.mcp.jsonrpc_id": "1",
    }
    if decision.rule_id and not reason_override:
        attrs["egressgate.rule"] = decision.rule_id
    if record_arguments:
        attrs["egressgate.mcp.arguments"] = arguments
    if facts:
        attrs["egressgate.mcp.facts"] = {"server_calls": server_calls, "tool_calls": tool_calls}
    return dumps(to_otlp(Record(int(time_s * 1e9), 9, "INFO", "egressgate.mcp_tool_call", "", attrs)))


def record_session(path, old_path):
    """Decide each call under OLD as the mediator does (counts from earlier allowed calls) and record it."""
    policy = load_policy(old_path)
    calls = [  # (tool, arguments decided on, as recorded (None: not recorded), facts recorded, reason override)
        ("search_tickets", '{"limit":20,"project":"acme"}', "=", True, None),  # allow -> deny (max 10)
        ("search_tickets", '{"limit":5,"project":"acme"}', "=", True, None),  # unchanged
        ("wide_open", '{"x":1}', None, True, None),  # allow -> deny (tool removed), arguments unknown
        ("search_tickets", '{"limit":99,"project":"acme"}', None, True, None),  # old deny on an argument
        ("search_tickets", '{"limit":3,"project":"acme"}', '{"limit":3,"project":"[REDACTED]"}', True, None),
        ("search_tickets", '{"limit":3,"project":"acme"}', "=", False, None),  # no facts: counts from the log
        ("search_tickets", '{"limit":3,"project":"acme"}', "=", True, "mcp_malformed"),  # outside the policy
    ]
    lines, counts = [], {"server": 0, "tool": {}}
    for i, (tool, raw, recorded, rec_facts, override) in enumerate(calls):
        tool_calls = counts["tool"].get(tool, 0)
        facts = McpFacts("sbx-1", LABELS, counts["server"], tool_calls, None, None, None, None)
        decision = decide_tool_call(policy, ToolCall("tickets", tool, json.loads(raw)), facts, T0 + i)
        if decision.allowed and override is None:
            counts["server"] += 1
            counts["tool"][tool] = tool_calls + 1
        lines.append(_record(T0 + i, decision, tool=tool, arguments=raw if recorded == "=" else recorded,
                             record_arguments=recorded is not None, facts=rec_facts, tool_calls=tool_calls,
                             server_calls=facts.server_calls, reason_override=override))
    path.write_bytes(b"\n".join(lines) + b"\n")


def _write_policies(tmp_path):
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(textwrap.dedent(OLD))
    new.write_text(textwrap.dedent(NEW))
    return old, new


def test_replay_under_the_recording_policy_changes_nothing(tmp_path):
    old, _ = _write_policies(tmp_path)
    log = tmp_path / "audit.jsonl"
    record_session(log, old)
    result = replay([log], old)
    assert result.changes == []
    assert result.replayed == 5 and result.unchanged == 5
    assert result.arguments_unchecked == 2  # wide_open (not recorded) and the redacted one
    assert result.approximated_state == 1
    assert result.skipped == {"argument checks not replayable (arguments not recorded; set "
                              "mcp.record_arguments)": 1, "decided outside the policy (mcp_malformed)": 1}


def test_replay_under_a_stricter_policy_finds_each_change(tmp_path):
    old, new = _write_policies(tmp_path)
    log = tmp_path / "audit.jsonl"
    record_session(log, old)
    result = replay([log], new)
    got = [(c.target, c.direction, c.new_reason) for c in result.changes]
    assert got == [
        ("mcp tickets/search_tickets", "allow->deny", "mcp_argument_denied"),  # limit 20 > new max 10
        ("mcp tickets/wide_open", "allow->deny", "mcp_tool_denied"),
        ("mcp tickets/search_tickets", "allow->deny", "budget_exceeded"),  # recorded tool_calls 2 >= new 2
        # no recorded facts: 3 allowed searches before it in the log (calls 1, 2 and 5)
        ("mcp tickets/search_tickets", "allow->deny", "budget_exceeded"),
    ]
    # the old argument denial without recorded arguments is now refused by the budget: a deny either way
    assert result.replayed == 6 and result.unchanged == 2
    table = format_table(result)
    assert "mcp tickets/wide_open" in table and "argument constraints not checked" not in table
    assert result.arguments_unchecked == 0  # every call allowed before is now denied: a deny is certain
    assert "2 MCP tool calls allowed without their arguments" in format_table(replay([log], old))
    r = CliRunner().invoke(audit, ["replay", str(log), "--policy", str(new)])
    assert r.exit_code == 1 and "mcp tickets/search_tickets" in r.output


# --- end to end: the real mediator records, replay reads them ------------------------------------------


@pytest.mark.parametrize("record_arguments", [True, False])
async def test_replay_of_records_written_by_the_mediator(tmp_path, record_arguments):
    from egressgate.state.memory import MemoryState
    from tests.mcp.mediator_world import body, make_world, policy_text
    from tests.mcp.mediator_world import call as rpc

    text = policy_text(record_arguments)
    world = await make_world(tmp_path, MemoryState(), record_arguments=record_arguments)
    try:
        session = world.session()
        sent = [("search_tickets", {"project": "acme", "query": "printer"})] * 4  # tool budget 3: 4th denied
        sent += [("delete_ticket", {}), ("note", {"x": 1}), ("search_tickets", {"project": "globex"})]
        for i, (tool, arguments) in enumerate(sent):
            await session.from_client(body(rpc(i, tool, arguments)))
    finally:
        await world.rt.audit.close()
    log = world.var / "audit.jsonl"
    old = tmp_path / "old.yaml"
    old.write_text(text)
    same = replay([log], old)
    assert same.changes == [] and same.replayed == 7 and same.approximated_state == 0
    # not recorded: 3 searches and the note are allowed without their arguments re-checked; the globex
    # argument denial is a deny anyway (the tool budget is spent by then)
    assert same.arguments_unchecked == (0 if record_arguments else 4) and same.skipped == {}

    new = tmp_path / "new.yaml"
    new.write_text(text.replace("query: {type: string, max_length: 40}", "query: {type: string, max_length: 3}")
                   .replace("          - name: note\n            unlisted_arguments: allow\n", ""))
    result = replay([log], new)
    got = [(c.target, c.direction, c.new_reason) for c in result.changes]
    expected = [("mcp tickets/note", "allow->deny", "mcp_tool_denied")]
    if record_arguments:  # 'printer' is longer than the new max_length: each allowed search now refused
        expected = [("mcp tickets/search_tickets", "allow->deny", "mcp_argument_denied")] * 3 + expected
    assert got == expected
