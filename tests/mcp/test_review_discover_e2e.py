"""Adversarial review (h-review), end to end: the SDK's DEFAULT client (`Client(...)`, mode "auto": it sends
`server/discover`, never `initialize`) through `egressgate mcp run` against a real SDK stdio server whose
serverInfo is pinned in the policy. Before the fix every call was refused `mcp_server_changed`
(server_info_unseen) even from the pinned server, because serverInfo was read from `initialize` answers
only (and a trust-on-first-use pin was never enforced for such clients: tests/mcp/test_review_discover.py).
Positive control and adversarial case in one: the matching pin lets the call through and the server
records it; a pin of another version refuses it and the server never sees it."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError

import tests.networld as nw
from tests.mcp.local_world import calls, child_env, mcp_argv, mcp_policy
from tests.networld import World
from tests.runtimes.harness import Gateway, base_dir, remove


def pinned(name: str, version: str) -> dict:
    body = mcp_policy(name)
    body["mcp"]["servers"][0]["server_info"] = {"name": "local-tools", "version": version}
    return body


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    world = World.create(tmp_path_factory.mktemp("networld"))
    world.exec(world.net, "ip", "route", "add", "198.18.128.0/17", "via", nw.GW_NET)
    base = base_dir()
    try:
        gw = Gateway.start(world, base, {"erv-pin-ok": pinned("erv-pin-ok", "1.0.0"),
                                         "erv-pin-bad": pinned("erv-pin-bad", "9.9.9")})
        try:
            yield gw
        finally:
            gw.stop()
    finally:
        remove(base)
        world.close()


async def _echo(gw: Gateway, policy: str, workspace: Path):
    argv = mcp_argv(gw, policy, workspace=workspace, tag=secrets.token_hex(6))
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=child_env())
    async with Client(params, read_timeout_seconds=30) as client:  # default mode: server/discover
        try:
            return await client.call_tool("echo", {"text": "hello pinned"})
        except MCPError as exc:  # returned: raised out of the client's task group it would be a group
            return exc


async def test_default_sdk_client_meets_a_serverinfo_pin_and_another_version_is_refused(gateway: Gateway):
    ok_ws, bad_ws = (gateway.base / f"ws-{secrets.token_hex(4)}" for _ in range(2))
    ok = await _echo(gateway, "erv-pin-ok", ok_ws)
    assert not isinstance(ok, MCPError), ok.data
    assert not ok.is_error and ok.content[0].text == "hello pinned"
    assert [c["tool"] for c in calls(ok_ws) if c["event"] == "call"] == ["echo"]
    refused = await _echo(gateway, "erv-pin-bad", bad_ws)
    assert isinstance(refused, MCPError) and refused.code == -32001
    assert refused.data["reason"] == "mcp_server_changed"
    assert [c for c in calls(bad_ws) if c["event"] == "call"] == []  # the server never saw the call
