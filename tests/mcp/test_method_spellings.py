"""MCP method spellings and batches (issue 23, item 10), on the real mediator (memory store, file sink).

A `Tools/Call` (or any spelling of a method the gateway does not know) used to be forwarded as an ordinary
request: no decision, no record — a lenient server would run it as a tool call. Every request and
notification whose method is not an MCP client method, spelled exactly, is now refused whole and audited
(`mcp_message`, `mcp_malformed`, detail `unknown_method`). Batches are refused on protocol versions that
have none (all but 2025-03-26, and an unknown version). Positive controls: the exact spelling is decided
and forwarded; known non-call methods pass; a batch on 2025-03-26 is forwarded.
"""

from __future__ import annotations

import json

import pytest

from tests.mcp.mediator_world import World, answer, body, call, initialize

SPELLINGS = [
    "Tools/Call",
    "TOOLS/CALL",
    "tools/Call",
    "tools/call ",
    " tools/call",
    "tools/call\u0000",
    "tools\\/call-x",
    "tools/calls",
    "tool/call",
    "tools//call",
]


@pytest.mark.parametrize("method", SPELLINGS)
async def test_a_misspelled_tools_call_is_refused_and_recorded(mem_world: World, method: str):
    s = mem_world.session()
    smuggled = {**call(7, "delete_ticket", {"id": "all"}), "method": method}
    verdict = await s.from_client(body(smuggled))
    assert verdict.forward is None and verdict.refused
    [reply] = verdict.replies
    assert reply["id"] == 7 and reply["error"]["data"]["reason"] == "mcp_malformed"
    assert "unknown_method" in reply["error"]["message"]
    [rec] = await mem_world.wait_records(1, **{"egressgate.operation": "mcp_message"})
    assert rec["egressgate.reason"] == "mcp_malformed" and rec["egressgate.detail"] == "unknown_method"
    # positive control: the exact spelling is decided (recorded) and, allowed, forwarded
    ok = await s.from_client(body(call(8, "search_tickets", {"project": "acme"})))
    assert ok.forward is not None and json.loads(ok.forward)["method"] == "tools/call"
    [decided] = mem_world.records(**{"egressgate.operation": "mcp_tool_call"})
    assert decided["egressgate.decision"] == "allow" and decided["egressgate.mcp.jsonrpc_id"] == "8"


@pytest.mark.parametrize(
    ("message", "forwarded"),
    [
        ({"jsonrpc": "2.0", "id": 1, "method": "resources/list"}, True),
        ({"jsonrpc": "2.0", "id": 1, "method": "prompts/get", "params": {"name": "x"}}, True),
        ({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}, True),
        ({"jsonrpc": "2.0", "id": 1, "method": "admin/exec"}, False),
        ({"jsonrpc": "2.0", "id": 1, "method": "notifications/initialized"}, False),  # a notification as a request
        ({"jsonrpc": "2.0", "method": "ping"}, False),  # a request as a notification
        ({"jsonrpc": "2.0", "method": "Notifications/Initialized"}, False),
    ],
)
async def test_only_mcp_client_methods_pass(mem_world: World, message: dict, forwarded: bool):
    verdict = await mem_world.session().from_client(body(message))
    assert (verdict.forward is not None) is forwarded, verdict
    if not forwarded:
        [rec] = await mem_world.wait_records(1, **{"egressgate.operation": "mcp_message"})
        assert rec["egressgate.detail"] == "unknown_method"


@pytest.mark.parametrize("protocol", ["2024-11-05", "2025-06-18", "2025-11-25", None])
async def test_batches_are_refused_where_the_protocol_has_none(mem_world: World, protocol: str | None):
    s = mem_world.session()
    if protocol is not None:
        await initialize(s, "init", "tickets-server", "1", protocol=protocol)
    batch = [call(1, "search_tickets", {"project": "acme"}), {"jsonrpc": "2.0", "id": 2, "method": "ping"}]
    verdict = await s.from_client(body(batch))
    assert verdict.forward is None and verdict.refused
    assert verdict.replies[0]["error"]["data"]["reason"] == "mcp_malformed"
    assert "batch_not_supported" in verdict.replies[0]["error"]["message"]
    assert mem_world.records(**{"egressgate.operation": "mcp_tool_call"}) == []  # nothing decided or counted
    # positive control: the same messages one at a time are decided and forwarded
    assert (await s.from_client(body(batch[0]))).forward is not None
    assert (await s.from_client(body(batch[1]))).forward is not None


async def test_a_batch_passes_on_2025_03_26(mem_world: World):
    """Control: the one protocol version with batches; the server's answer sets the version, not the client."""
    s = mem_world.session()
    await initialize(s, "init", "tickets-server", "1", protocol="2025-03-26")
    batch = [call(1, "search_tickets", {"project": "acme"}), {"jsonrpc": "2.0", "id": 2, "method": "ping"}]
    verdict = await s.from_client(body(batch))
    assert json.loads(verdict.forward) == batch and verdict.replies == []
    answered = json.loads(
        await s.from_server_bytes(json.dumps([json.loads(answer(1)), json.loads(answer(2, {}))]).encode())
    )
    assert [a["id"] for a in answered] == [1, 2]
