"""Adversarial review (h-review), remote and end to end: the SDK's DEFAULT client (`Client(...)`, mode "auto":
`server/discover` on the 2026-07-28 protocol, never `initialize`) through the gateway's remote MCP route.
Trust on first use of serverInfo is per sandbox across sessions: the server's version changes between two
sessions of one sandbox and the second session's call must be refused (`mcp_server_changed`), as it is for
a legacy (initialize) client (test_remote_streamable.test_a_server_version_change_denies_its_tools). Before
the fix the mediator read serverInfo from `initialize` answers only: this call went through."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tests.mcp.remote_world import RemoteWorld, Sandbox, error_of, open_remote_world, raw_initialize
from tests.mcp.servers import VERSION, set_version


def upgrade(rw: RemoteWorld, version: str) -> None:
    """A server upgrade as a 2026-07-28 client sees it: the version AND the serverInfo stamp every result
    carries (the SDK caches the stamp per server object; a real upgrade is a new process)."""
    set_version(rw.mcp.json, version)
    rw.mcp.json._lowlevel_server.__dict__.pop("_server_info_stamp_source", None)


@pytest.fixture(scope="module")
def rw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteWorld]:
    with open_remote_world(tmp_path_factory.mktemp("erv-remote")) as world:
        yield world


@contextlib.asynccontextmanager
async def default_client(rw: RemoteWorld, sbx: Sandbox):
    http = sbx.http2()
    async with http, Client(streamable_http_client(rw.url("json"), http_client=http),
                            read_timeout_seconds=15) as client:  # no mode=: the SDK default
        yield client


async def test_default_client_server_version_change_between_sessions_is_refused(rw: RemoteWorld) -> None:
    sbx = rw.admit()
    mark = rw.mcp.received.mark()
    async with default_client(rw, sbx) as client:  # first sight: tickets-json VERSION
        assert not (await client.call_tool("search_tickets", {"project": "acme"})).is_error  # positive control
    methods = [m.get("method") for m in rw.mcp.received.messages(mark)]
    assert "server/discover" in methods and "initialize" not in methods  # the modern handshake indeed
    upgrade(rw, "1.5.0-evil")
    try:
        async with default_client(rw, sbx) as client:
            with pytest.raises(MCPError) as caught:
                await client.call_tool("search_tickets", {"project": "acme"})
    finally:
        upgrade(rw, VERSION)
    assert error_of(caught.value)["data"]["reason"] == "mcp_server_changed"
    assert len(rw.mcp.received.tool_calls(mark)) == 1  # the upstream never saw the second call


CALL = ('{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"search_tickets",'
        '"arguments":{"project":"acme"}}}')


def test_another_sandboxs_session_id_hidden_in_a_duplicate_header_is_refused(rw: RemoteWorld) -> None:
    """mitmproxy's `headers.get` joins two Mcp-Session-Id headers ("sidA, x": a session nobody owns, so the
    owner check passes) while the server (Starlette) reads the FIRST one: the intruder speaks in the owner's
    server-side session. Control: the stolen id alone is refused (test_remote_streamable)."""
    owner, intruder = rw.admit(), rw.admit()
    with owner.raw() as client, intruder.raw() as other:
        headers = raw_initialize(client, rw.url("json"))
        mark = rw.mcp.received.mark()
        sid = headers["Mcp-Session-Id"]
        alone = other.post(rw.url("json"), content=(CALL % 20).encode(), headers=headers)
        doubled = [(k, v) for k, v in headers.items() if k != "Mcp-Session-Id"]
        doubled += [("Mcp-Session-Id", sid), ("Mcp-Session-Id", "intruder-chosen")]
        smuggled = other.post(rw.url("json"), content=(CALL % 21).encode(), headers=doubled)
    assert alone.status_code == 400  # control: the owner check itself works
    assert smuggled.status_code == 400, smuggled.text  # before the fix: 200, answered in the owner's session
    assert [m.get("id") for m in rw.mcp.received.messages(mark)] == []
