"""One decision record and one outcome record per MCP tool call through the gateway (issue 25, item 3).

A streamable-HTTP POST carrying a `tools/call` used to write four records: the POST's `http_request`
allow (gateway/pipeline/record.py), the call's `mcp_tool_call`, the call's MCP `outcome` and the POST's HTTP
`outcome`. The POST's network decision is now folded into the call's `mcp_tool_call` record and the
call's outcome into the POST's outcome (docs/audit.md "MCP"): per call one decision record and one
outcome, under one request id, with every fact either decision read so `audit replay` re-decides both.

Counted the way an auditor would: two sessions of the same real SDK client against the same real SDK
server, one making 1 call and one making 3 (the SDK's own requests — initialize, the notification,
the one tools/list its result validation asks for, the stream, the DELETE — are the same in both), so
the difference in records is what the 2 extra calls wrote. Positive control: the HTTP+SSE transport,
whose calls are answered on another flow and so keep their POST's own records, counted the same way
shows two decision records and two outcomes per call — the count sees a second record when there is one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from egressgate.audit.find import iter_records
from egressgate.audit.replay import load_policy_set, replay_records
from tests.mcp.remote_world import RemoteWorld, Sandbox, open_remote_world
from tests.support.launcher import write_policies
from tests.support.replay_check import trail_files
from tests.support.waiting import wait_for

DECISIONS = ("http_request", "mcp_tool_call")
ARGS = {"project": "acme", "limit": 3}


@pytest.fixture(scope="module")
def rw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteWorld]:
    with open_remote_world(tmp_path_factory.mktemp("mcp-one-record")) as world:
        yield world


def _mine(rw: RemoteWorld, sbx: Sandbox) -> list[dict]:
    return [r for r in rw.gw.audit_records() if r.get("egressgate.sandbox.id") == sbx.id]


def _settled(rw: RemoteWorld, sbx: Sandbox) -> list[dict]:
    """The sandbox's records once every allowed decision has its outcome (outcomes are written behind)."""

    def done() -> bool:
        records = _mine(rw, sbx)
        closed = {r.get("egressgate.request.id") for r in records if r["egressgate.operation"] == "outcome"}
        return all(
            r.get("egressgate.request.id") in closed
            for r in records
            if r["egressgate.operation"] in DECISIONS and r.get("egressgate.decision") == "allow"
        )

    wait_for(done)
    return _mine(rw, sbx)


async def _session(rw: RemoteWorld, kind: str, calls: int) -> tuple[Sandbox, list[dict]]:
    sbx = rw.admit()
    async with rw.client(sbx, kind) as client:
        for _ in range(calls):
            result = await client.call_tool("search_tickets", ARGS)
            assert not result.is_error and result.content[0].text == "3 open tickets in acme"
    return sbx, _settled(rw, sbx)


def _replay(rw: RemoteWorld, sbx: Sandbox):
    """`audit replay` of the sandbox's own trail with the policy it ran under."""
    policies, _single = load_policy_set(Path(rw.gw.var).parent / "policies")
    found = [
        f
        for f in iter_records(trail_files(Path(rw.gw.var)))
        if f.record.attributes.get("egressgate.sandbox.id") == sbx.id
    ]
    return replay_records(found, policies, None)


def _count(records: list[dict]) -> tuple[int, int]:
    ops = [r["egressgate.operation"] for r in records]
    return sum(op in DECISIONS for op in ops), ops.count("outcome")


async def _extra_records_per_call(rw: RemoteWorld, kind: str) -> tuple[float, float, list[dict], Sandbox]:
    _a, one = await _session(rw, kind, 1)
    b, three = await _session(rw, kind, 3)
    (d1, o1), (d3, o3) = _count(one), _count(three)
    return (d3 - d1) / 2, (o3 - o1) / 2, three, b


@pytest.mark.parametrize("kind", ["json", "sse"])  # the server answers as JSON / as an SSE stream
async def test_a_tool_call_writes_one_decision_record_and_one_outcome(rw: RemoteWorld, kind: str) -> None:
    decisions, outcomes, records, sbx = await _extra_records_per_call(rw, kind)
    assert (decisions, outcomes) == (1, 1), [
        (r["egressgate.operation"], r.get("egressgate.request.id")) for r in records
    ]
    calls = [r for r in records if r["egressgate.operation"] == "mcp_tool_call"]
    assert len(calls) == 3
    for call in calls:
        rid = call["egressgate.request.id"]
        same = [r for r in records if r.get("egressgate.request.id") == rid]
        assert [r["egressgate.operation"] for r in same] == ["mcp_tool_call", "outcome"]
        outcome = same[1]
        # the call's record is also the POST's network decision: its facts are all there
        assert (call["egressgate.decision"], call["egressgate.rule"]) == ("allow", f"tickets-{kind}-search")
        assert (call["egressgate.network.rule"], call["egressgate.network.reason"]) == ("tickets-mcp", "rule_matched")
        assert call["http.request.method"] == "POST" and call["url.path"] == f"/{kind}/mcp"
        assert call["egressgate.pinned.address"] == "127.0.0.1" and "egressgate.state.bytes_out" in call
        assert "egressgate.mcp.facts" in call  # what the call decision read (counts, pins)
        # the POST's outcome is also the call's
        assert int(outcome["http.response.status_code"]) == 200 and int(outcome["egressgate.bytes.in"]) > 0
        assert (outcome["egressgate.mcp.outcome"], outcome["egressgate.mcp.is_error"]) == ("result", False)
        assert outcome["egressgate.mcp.tool"] == "search_tickets" and int(outcome["egressgate.mcp.result_bytes"]) > 0
    # both decisions of each folded record replay unchanged with the recording policy: network and call
    result = _replay(rw, sbx)
    assert result.changes == []
    plain = sum(r["egressgate.operation"] in ("http_request", "connect") for r in records)
    assert result.replayed == plain + 2 * len(calls)


async def test_a_denied_call_is_one_record_with_the_network_decision_too(rw: RemoteWorld) -> None:
    from mcp import MCPError

    sbx = rw.admit()
    async with rw.client(sbx, "json") as client:
        with pytest.raises(MCPError):
            await client.call_tool("delete_ticket", {"ticket": "T-1"})
    records = _settled(rw, sbx)
    [call] = [r for r in records if r["egressgate.operation"] == "mcp_tool_call"]
    assert (call["egressgate.decision"], call["egressgate.reason"]) == ("deny", "mcp_tool_denied")
    assert call["egressgate.network.rule"] == "tickets-mcp"
    rid = call["egressgate.request.id"]
    same = [r["egressgate.operation"] for r in records if r.get("egressgate.request.id") == rid]
    assert same == ["mcp_tool_call", "outcome"]  # the gateway's own JSON-RPC answer to the POST
    result = _replay(rw, sbx)
    assert result.changes == [] and result.replayed >= 2  # the call and the POST's network decision


async def test_positive_control_http_sse_calls_keep_two_records_each_and_the_count_sees_them(rw: RemoteWorld) -> None:
    """The legacy HTTP+SSE transport answers a call on its stream (another flow), so the POST keeps its
    own `http_request` and outcome records: the same count finds 2 + 2 per call there."""
    decisions, outcomes, records, _sbx = await _extra_records_per_call(rw, "old")
    assert (decisions, outcomes) == (2, 2), [r["egressgate.operation"] for r in records]
    calls = [r for r in records if r["egressgate.operation"] == "mcp_tool_call"]
    assert len(calls) == 3 and not any("egressgate.network.rule" in c for c in calls)


async def test_replay_re_decides_the_folded_network_decision(rw: RemoteWorld, tmp_path: Path) -> None:
    """The network half of a folded record is really re-decided: under a policy whose route rule no longer
    allows POST, replay flips exactly the POSTs (their calls' records, as `http_request`), while the
    recording policy flips nothing (above)."""
    sbx, _records = await _session(rw, "json", 1)
    doc = yaml.safe_load((Path(rw.gw.var).parent / "policies" / "mcp-remote.yaml").read_text())
    [rule] = [r for r in doc["network"]["https"]["allow"] if r["id"] == "tickets-mcp"]
    rule["methods"] = ["GET", "DELETE"]
    policies, _single = load_policy_set(write_policies(tmp_path / "policies", {"mcp-remote": doc}))
    found = [
        f
        for f in iter_records(trail_files(Path(rw.gw.var)))
        if f.record.attributes.get("egressgate.sandbox.id") == sbx.id
    ]
    changes = replay_records(found, policies, None).changes
    assert changes and all(
        (c.operation, c.old_rule, c.new_decision) == ("http_request", "tickets-mcp", "deny") for c in changes
    )
    folded = {
        f.record.attributes["egressgate.request.id"]
        for f in found
        if f.record.attributes.get("egressgate.network.rule") == "tickets-mcp"
    }
    assert len(folded) == 1 and folded <= {c.request_id for c in changes}  # the call's POST among them
