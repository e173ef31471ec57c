"""Adversarial review (h-review): JSON-RPC id reuse between a pending non-call request and a tools/call.

Before the fix only ids of pending CALLS were refused: a `ping` id 7 still unanswered, then a
`tools/call` id 7, made the ping's answer (`{}`) the recorded outcome of the call, and the call's real
result passed to the client unrecorded (the audit trail's "what actually happened" was the attacker's
choice). Real mediator, real memory store, real audit file sink (tests/mcp/mediator_world.py)."""

from __future__ import annotations

import asyncio
import json

from egressgate.mcp.mediator import MAX_WAITING
from tests.mcp.mediator_world import World, answer, body, call, initialize

PING = {"jsonrpc": "2.0", "id": 7, "method": "ping"}
SECRET = {"content": [{"type": "text", "text": "exfiltrated " * 50}]}


async def test_a_call_reusing_the_id_of_a_pending_ping_is_refused(mem_world: World):
    s = mem_world.session()
    assert (await s.from_client(body(PING))).forward is not None
    reused = await s.from_client(body(call(7, "search_tickets", {"project": "acme"})))
    assert reused.forward is None and reused.refused
    assert "id_in_use" in reused.replies[0]["error"]["message"]
    assert mem_world.records(**{"egressgate.operation": "mcp_tool_call"}) == []  # nothing decided
    # positive control: once the ping is answered the id is free, and the call's REAL answer is its outcome
    assert json.loads(await s.from_server_bytes(answer(7, {}))) == {"jsonrpc": "2.0", "id": 7, "result": {}}
    ok = await s.from_client(body(call(7, "search_tickets", {"project": "acme"})))
    assert ok.forward is not None and ok.replies == []
    await s.from_server_bytes(answer(7, SECRET))
    [outcome] = await mem_world.wait_records(**{"egressgate.operation": "outcome"})
    assert int(outcome["egressgate.mcp.result_bytes"]) == len(json.dumps(SECRET, separators=(",", ":")))


async def test_a_ping_reusing_the_id_of_a_pending_call_is_refused_and_concurrent_bodies_too(mem_world: World):
    s = mem_world.session()
    assert (await s.from_client(body(call(8, "note", {})))).forward is not None
    again = await s.from_client(body({**PING, "id": 8}))
    assert again.forward is None and "id_in_use" in again.replies[0]["error"]["message"]
    # a ping and a call with one id sent at once: exactly one of them is forwarded
    a, b = await asyncio.gather(s.from_client(body({**PING, "id": 9})), s.from_client(body(call(9, "note", {}))))
    assert [v.forward is not None for v in (a, b)].count(True) == 1


async def test_pending_requests_are_bounded(mem_world: World):
    s = mem_world.session()
    await initialize(s, "init", "tickets-server", "1", protocol="2025-03-26")  # the protocol with batches
    batch = [{**PING, "id": i} for i in range(MAX_WAITING)]
    assert (await s.from_client(body(batch))).forward is not None  # positive control: the bound itself
    over = await s.from_client(body({**PING, "id": "one-more"}))
    assert over.forward is None and "too_many_pending" in over.replies[0]["error"]["message"]
    await s.from_server_bytes(json.dumps([{"jsonrpc": "2.0", "id": i, "result": {}} for i in range(10)]).encode())
    assert (await s.from_client(body({**PING, "id": "one-more"}))).forward is not None


async def test_a_long_id_is_tracked_too(mem_world: World):
    s = mem_world.session()
    long_id = "x" * 100_000
    assert (await s.from_client(body({**PING, "id": long_id}))).forward is not None
    reused = await s.from_client(body(call(long_id, "note", {})))
    assert reused.forward is None and "id_in_use" in reused.replies[0]["error"]["message"]
    assert all(len(k) <= 64 for k in s.outstanding if isinstance(k, (str, bytes)))  # kept as a digest
    await s.from_server_bytes(answer(long_id, {}))
    assert (await s.from_client(body(call(long_id, "note", {})))).forward is not None  # answered: free again
