"""Another spelling of the MCP endpoint's path is still the MCP route (policy/mcp_compile.McpServer.serves_path).

The upstream here reads request paths the way nginx does by default (`merge_slashes`) and Tomcat does with
path parameters (`;jsessionid=...` stripped): `//mcp` and `/mcp;x` are its MCP endpoint. If the gateway
matched MCP routes on the canonical path alone, a `tools/call` POSTed to `//mcp` would be a plain allowed
POST and reach the server unmediated. Positive controls: the upstream does execute a call sent to it
directly under those spellings (the leak is real), and an allowed call through the gateway under them is
mediated and forwarded.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import trustme

from tests.support.launcher import LoopbackGateway, launch_loopback, stop_gateway, write_policies
from tests.support.loopback import DnsServer, LoopThread, serve_json, start_dns

HOST = "spelling.mcp.test"


@dataclass
class NginxLikeMcp:
    """HTTPS/1.1 on 127.0.0.1: any POST whose path, slashes merged and `;params` dropped, is `/mcp` runs the
    JSON-RPC call it carries (answered with a result naming the tool) and is recorded."""

    ca: trustme.CA
    received: list[bytes] = field(default_factory=list)
    port: int = 0

    async def start(self) -> asyncio.base_events.Server:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert(HOST, "127.0.0.1").configure_cert(ctx)
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=ctx)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_json(reader, writer, self._answer)

    def _answer(self, target: str, body: bytes) -> tuple[bytes, bytes]:
        path = re.sub(r";[^/]*", "", re.sub(r"/+", "/", target.split("?", 1)[0]))
        if path != "/mcp" or not body:
            return b"404 Not Found", b"{}"
        self.received.append(body)
        message = json.loads(body)
        tool = message.get("params", {}).get("name")
        return b"200 OK", json.dumps({"jsonrpc": "2.0", "id": message.get("id"),
                                      "result": {"content": [{"type": "text", "text": f"ran {tool}"}]}}).encode()


@dataclass
class World:
    upstream: NginxLikeMcp
    gw: LoopbackGateway
    ca: trustme.CA


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("e13e-spellings")
    ca = trustme.CA()
    loop = LoopThread()
    dns = DnsServer()
    transport, dns_port = loop.run(start_dns(dns))
    dns.records[HOST] = "127.0.0.1"
    upstream = NginxLikeMcp(ca)
    server = loop.run(upstream.start())
    gw = None
    try:
        policy = {
            "sandbox": {"name": "spellings"},
            "network": {"allow_private": ["127.0.0.1/32"], "https": {"allow": [
                {"id": "spelling-host", "host": HOST, "ports": [upstream.port], "methods": ["POST"]}]}},
            "mcp": {"servers": [{"name": "spelling", "url": f"https://{HOST}:{upstream.port}/mcp",
                                 "tools": {"allow": [{"name": "search_tickets", "unlisted_arguments": "allow"}],
                                           "deny": ["delete_ticket"]}}]},
        }
        bundle = tmp / "upstream-ca.pem"
        bundle.write_bytes(ca.cert_pem.bytes())
        config = {"listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
                  "policy": str(write_policies(tmp / "policies", {"spellings": policy})), "var_dir": str(tmp / "var"),
                  "upstream": {"resolver": f"127.0.0.1:{dns_port}", "ca_bundle": str(bundle)}}
        gw = LoopbackGateway(**launch_loopback(tmp, config))
        yield World(upstream, gw, ca)
    finally:
        if gw is not None:
            stop_gateway(gw)
        loop.close((), (server,), (transport,))


def _call(tool: str, jid: int) -> dict:
    return {"jsonrpc": "2.0", "id": jid, "method": "tools/call", "params": {"name": tool, "arguments": {"q": "x"}}}


@pytest.mark.parametrize("path", ["//mcp", "/mcp;jsessionid=1"])
def test_a_denied_call_under_another_spelling_never_reaches_the_server(world: World, path: str):
    # positive control: sent to the server directly, this spelling runs the call (the leak is real)
    with httpx.Client(verify=_ctx(world.ca), trust_env=False, timeout=10) as direct:
        answer = direct.post(f"https://127.0.0.1:{world.upstream.port}{path}", json=_call("delete_ticket", 1))
    assert answer.json()["result"]["content"][0]["text"] == "ran delete_ticket"
    world.upstream.received.clear()

    sandbox = world.gw.admit_sandbox({"policy": "spellings"})
    proxy = sandbox["proxy_url"]
    url = f"https://{HOST}:{world.upstream.port}{path}"
    with httpx.Client(proxy=proxy, verify=ssl.create_default_context(cafile=world.gw.bundle), trust_env=False,
                      timeout=10) as client:
        denied = client.post(url, json=_call("delete_ticket", 2))
        assert denied.status_code == 200
        error = denied.json()["error"]
        assert (error["code"], error["data"]["reason"], error["data"]["egressgate"]) == \
            (-32001, "mcp_tool_denied", True)
        assert world.upstream.received == []  # the server never saw the denied call
        # positive control: an allowed call under the same spelling is mediated and forwarded
        allowed = client.post(url, json=_call("search_tickets", 3))
        assert "result" in allowed.json(), (path, allowed.status_code, allowed.text)
        assert allowed.json()["result"]["content"][0]["text"] == "ran search_tickets"
    assert [json.loads(b)["params"]["name"] for b in world.upstream.received] == ["search_tickets"]
    records = [r for r in world.gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox["id"]
               and r.get("egressgate.operation") == "mcp_tool_call"]
    assert [(r["egressgate.mcp.tool"], r["egressgate.decision"]) for r in records] == [
        ("delete_ticket", "deny"), ("search_tickets", "allow")]


def _ctx(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


def test_other_paths_stay_plain_requests(world: World):
    """Positive control of the matching itself: a path no server reading maps to the endpoint is not the
    MCP route (forwarded as any allowed POST; this upstream answers it 404 without running anything)."""
    sandbox = world.gw.admit_sandbox({"policy": "spellings"})
    with httpx.Client(proxy=sandbox["proxy_url"], verify=ssl.create_default_context(cafile=world.gw.bundle),
                      trust_env=False, timeout=10) as client:
        other = client.post(f"https://{HOST}:{world.upstream.port}/other", json=_call("delete_ticket", 4))
    assert other.status_code == 404 and other.json() == {}
