"""One decision record and one outcome record per MCP tool call through the gateway (issue 25, item 3).

A streamable-HTTP POST carrying a `tools/call` used to write four records: the POST's `http_request`
allow (gateway/pipeline/record.py), the call's `mcp_tool_call`, the call's MCP `outcome` and the POST's HTTP
`outcome`. The POST's network decision is now folded into the call's `mcp_tool_call` record and the
call's outcome into the POST's outcome (docs/audit.md "MCP"): per call one decision record and one
outcome, under one request id, with every fact either decision read so `audit replay` re-decides both.

Counted the way an auditor would: two sessions of the same real SDK client against the same real SDK
server, one making 1 call and one making 3 (the SDK's own requests — initialize, the notification,
the one tools/list its result validation asks for, the stream, the DELETE — are the same in both), so
the difference in records is what the 2 extra calls wrote. The HTTP+SSE transport too: its call's
answer comes on the stream (another flow) after the POST's 202, so the POST's outcome record waits for
it (mcp/pending.HeldOutcome) and carries it. A batch's later calls have their own `mcp_tool_call`
record and MCP outcome (the POST's records are the first call's): one of each per call as well.
Positive control: each step of a session making a call AND a tools/list, counted the same way, shows
two decision records and two outcomes — the count sees a second record when there is one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from egressgate.audit.find import iter_records
from egressgate.audit.replay import load_policy_set, replay_records
from tests.mcp.remote_world import ROGUE, RemoteWorld, Sandbox, open_remote_world
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


@pytest.mark.parametrize("kind", ["json", "sse", "old"])  # answers as JSON / SSE / on the HTTP+SSE stream
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
        path = "/old/messages/" if kind == "old" else f"/{kind}/mcp"  # HTTP+SSE: the announced endpoint
        assert call["http.request.method"] == "POST" and call["url.path"] == path
        assert call["egressgate.pinned.address"] == "127.0.0.1" and "egressgate.state.bytes_out" in call
        assert "egressgate.mcp.facts" in call  # what the call decision read (counts, pins)
        # the POST's outcome is also the call's (HTTP+SSE: the POST's 202, its answer came on the stream)
        if kind == "old":
            assert int(outcome["http.response.status_code"]) == 202
            assert float(outcome["egressgate.duration_ms"]) > 0
        else:
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


async def test_positive_control_the_count_sees_two_records_per_step_when_there_are_two(rw: RemoteWorld) -> None:
    """Each step makes a tools/call and a tools/list (a POST without a call keeps its own `http_request`
    record and outcome): the same count finds 2 + 2 per step, on both transports."""
    for kind in ("json", "old"):
        counts = []
        for steps in (1, 3):
            sbx = rw.admit()
            async with rw.client(sbx, kind) as client:
                for _ in range(steps):
                    assert not (await client.call_tool("search_tickets", ARGS)).is_error
                    await client.list_tools()
            counts.append(_count(_settled(rw, sbx)))
        (d1, o1), (d3, o3) = counts
        assert ((d3 - d1) / 2, (o3 - o1) / 2) == (2, 2), (kind, counts)


async def test_a_batchs_later_calls_have_one_decision_record_and_one_outcome_each(rw: RemoteWorld) -> None:
    """A 2025-03-26 batch of three calls in one POST: the first call's record is the POST's (folded), the
    others have their own `mcp_tool_call` record and MCP outcome; the POST writes no record of its own.
    Three calls, three decision records, three outcomes, each call's request id [mcp_tool_call, outcome];
    the trail replays unchanged."""
    sbx = rw.admit()
    batch = [
        {
            "jsonrpc": "2.0",
            "id": 61 + i,
            "method": "tools/call",
            "params": {"name": "lookup", "arguments": {"ticket": f"T-{i}"}},
        }
        for i in range(3)
    ]
    with sbx.raw() as client:
        res = client.post(
            f"https://{ROGUE}:{rw.mcp.port}/rogue/mcp/batch",
            json=batch,
            headers={"Accept": "application/json", "MCP-Protocol-Version": "2025-03-26"},
        )
    assert res.status_code == 200 and [a["id"] for a in res.json()] == [61, 62, 63], res.text
    records = _settled(rw, sbx)
    assert _count(records) == (3, 3), [(r["egressgate.operation"], r.get("egressgate.request.id")) for r in records]
    calls = [r for r in records if r["egressgate.operation"] == "mcp_tool_call"]
    assert [c["egressgate.mcp.jsonrpc_id"] for c in calls] == ["61", "62", "63"]
    assert all(c["egressgate.decision"] == "allow" for c in calls)
    assert ["egressgate.network.rule" in c for c in calls] == [True, False, False]  # the POST's is the first's
    for call in calls:
        same = [r for r in records if r.get("egressgate.request.id") == call["egressgate.request.id"]]
        assert [r["egressgate.operation"] for r in same] == ["mcp_tool_call", "outcome"]
        assert same[1]["egressgate.mcp.outcome"] == "result"
    assert _replay(rw, sbx).changes == []


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
