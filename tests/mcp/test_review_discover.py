"""Adversarial review (h-review): serverInfo pins on the 2026-07-28 protocol (no `initialize`).

The SDK's default client (`Client(...)`, mode "auto") sends `server/discover` and never `initialize`; the
server stamps its serverInfo into the `_meta` of every result instead. The mediator read serverInfo from
`initialize` answers only, so for a default client a trust-on-first-use pin was never enforced (a new
server version in a later session: calls allowed), and a policy pin refused every call even from the
pinned server (`server_info_unseen`). Messages below are the SDK's own wire shapes (recorded from a real
SDK client/server pair; end to end: test_review_modern_remote.py). Real mediator, real memory store
and audit file sink."""

from __future__ import annotations

import json

from egressgate.mcp.mediator import McpSession
from tests.mcp.mediator_world import LOOKUP, World, answer, body, call, initialize

META = {"_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientInfo": {"name": "mcp", "version": "0.1.0"},
                  "io.modelcontextprotocol/clientCapabilities": {}}}


def stamp(name: str, version: str) -> dict:
    return {"_meta": {"io.modelcontextprotocol/serverInfo": {"name": name, "version": version}}}


async def discover(s: McpSession, jid, name: str, version: str) -> None:
    request = {"jsonrpc": "2.0", "id": jid, "method": "server/discover", "params": META}
    assert (await s.from_client(body(request))).forward
    await s.from_server_bytes(answer(jid, {"cacheScope": "private", "capabilities": {"tools": {"listChanged": True}},
                                           "resultType": "complete", "supportedVersions": ["2026-07-28"],
                                           "ttlMs": 0, **stamp(name, version)}))


async def list_stamped(s: McpSession, jid, tools: list[dict], name: str, version: str) -> list[str]:
    assert (await s.from_client(body({"jsonrpc": "2.0", "id": jid, "method": "tools/list", "params": META}))).forward
    out = json.loads(await s.from_server_bytes(answer(jid, {"cacheScope": "private", "resultType": "complete",
                                                            "tools": tools, **stamp(name, version)})))
    return [t["name"] for t in out["result"]["tools"]]


def reason(verdict) -> str | None:
    return verdict.replies[0]["error"]["data"]["reason"] if verdict.replies else None


async def test_trust_on_first_use_holds_for_a_discover_client(mem_world: World):
    s1 = mem_world.session()
    await discover(s1, 1, "tickets-server", "1.4.2")
    assert (await s1.from_client(body(call(2, "note", {})))).forward  # control: the first sight is trusted
    s2 = mem_world.session()
    await discover(s2, 1, "tickets-server", "1.5.0")  # the server changed between sessions
    refused = await s2.from_client(body(call(2, "note", {})))
    assert refused.forward is None and reason(refused) == "mcp_server_changed"
    [rec] = await mem_world.wait_records(**{"egressgate.operation": "mcp_message"})
    assert rec["egressgate.reason"] == "mcp_server_changed" and rec["egressgate.detail"] == "server_info_tofu"
    s3 = mem_world.session()
    await discover(s3, 1, "tickets-server", "1.4.2")  # back to the first-seen version: allowed again
    assert (await s3.from_client(body(call(2, "note", {})))).forward


async def test_a_client_that_skips_discover_is_checked_on_the_tools_list_stamp(mem_world: World):
    s1 = mem_world.session()
    await initialize(s1, 0, "tickets-server", "1.4.2")  # a legacy session records the first sight
    assert (await s1.from_client(body(call(1, "note", {})))).forward
    s2 = mem_world.session()
    assert await list_stamped(s2, 1, [], "tickets-server", "9.9.9") == []
    refused = await s2.from_client(body(call(2, "note", {})))
    assert refused.forward is None and reason(refused) == "mcp_server_changed"


async def test_a_policy_pin_is_met_by_a_discover_client_and_refuses_another_version(mem_world: World):
    s = mem_world.session("pinned")
    await discover(s, 0, "pinned-server", "2.0.0")
    assert await list_stamped(s, 1, [LOOKUP], "pinned-server", "2.0.0") == ["lookup"]
    ok = await s.from_client(body(call(2, "lookup", {})))
    assert ok.forward is not None and ok.replies == []  # was refused server_info_unseen
    changed = mem_world.session("pinned")
    await discover(changed, 0, "pinned-server", "2.0.1")
    assert await list_stamped(changed, 1, [LOOKUP], "pinned-server", "2.0.1") == ["lookup"]
    refused = await changed.from_client(body(call(2, "lookup", {})))
    assert refused.forward is None and reason(refused) == "mcp_server_changed"
