"""The remote-MCP world: the SDK test servers (servers.py), a DNS name for them, and the real gateway
(`egressgate run`) with an `mcp` policy; an SDK client per sandbox whose httpx goes through the proxy.

Names: tickets.mcp.test and evil.mcp.test resolve (through the world's DNS server only) to 127.0.0.1
where the MCP server listens. Each test admits its own sandbox (budgets, TOFU pins and approvals are per
sandbox), so tests sharing one gateway and one server per module stay independent.
"""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import trustme
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client

from tests.mcp.servers import SECRET, McpWorld, serve_mcp
from tests.support.launcher import LoopbackGateway, launch_loopback, stop_gateway, write_policies
from tests.support.loopback import DnsServer, LoopThread, start_dns
from tests.support.replay_check import assert_replays_unchanged
from tests.support.waiting import wait_for

HOST = "tickets.mcp.test"
EVIL = "evil.mcp.test"
ROGUE = "rogue.mcp.test"
MAX_MESSAGE_BYTES = 16 * 1024  # small: an oversized body below 64 KiB is answered, not reset

def tools(server: str) -> dict[str, Any]:
    """The tools as the policy sees them (servers.tickets_server offers these and export_tickets); rule
    ids are `<server>-search`, `<server>-count`, ... (unique across the policy)."""
    return {
        "allow": [
            {"name": "search_tickets", "id": f"{server}-search", "budget": {"calls": 50},
             "arguments": {"project": {"equals_label": "tenant"},
                           "limit": {"type": "integer", "min": 1, "max": 50},
                           "status": {"enum": ["open", "closed"]}}},
            {"name": "count_tickets", "id": f"{server}-count", "budget": {"calls": 2},
             "arguments": {"project": {"equals_label": "tenant"}}},
            {"name": "lookup", "id": f"{server}-lookup",
             "arguments": {"ticket": {"type": "string", "pattern": "^T-[0-9]{1,6}$"}}},
            {"name": "slow_ticket", "id": f"{server}-slow", "arguments": {"ticket": {"type": "string"}}},
            {"name": "note", "id": f"{server}-note", "arguments": {"text": {"type": "string", "max_length": 200}}},
            {"name": "close_ticket", "id": f"{server}-close", "approval": "required",
             "arguments": {"ticket": {"type": "string", "pattern": "^T-[0-9]{1,6}$"}}},
        ],
        "deny": ["delete_ticket"],
    }


# what tools/list may show
ALLOWED = {"search_tickets", "count_tickets", "lookup", "slow_ticket", "note", "close_ticket"}
# transport kind -> server url path
KINDS = {"json": "/json/mcp", "sse": "/sse/mcp", "old": "/old/sse", "cred": "/cred/mcp"}


def policy(port: int, secret_file: str) -> dict[str, Any]:
    return {
        "sandbox": {"name": "mcp-remote"},
        "credentials": {"capabilities": {"tickets": {"type": "static", "source": {"file": secret_file}}}},
        "network": {"allow_private": ["127.0.0.1/32"], "https": {"allow": [
            {"id": "tickets-mcp", "host": HOST, "ports": [port], "methods": ["GET", "POST", "DELETE"],
             "paths": ["/json/**", "/sse/**", "/old/**"]},
            {"id": "tickets-cred", "host": HOST, "ports": [port], "methods": ["GET", "POST", "DELETE"],
             "paths": ["/cred/**"], "credential": "tickets"},
            {"id": "evil-mcp", "host": EVIL, "ports": [port], "methods": ["GET", "POST"], "paths": ["/evil/**"]},
            {"id": "rogue-mcp", "host": ROGUE, "ports": [port], "methods": ["POST"], "paths": ["/rogue/**"]},
        ]}},
        "mcp": {
            "max_message_bytes": MAX_MESSAGE_BYTES,
            "record_arguments": True,  # recorded with the route's credential redacted
            "servers": [
                {"name": "tickets-cred", "url": f"https://{HOST}:{port}/cred/mcp", "tools": tools("tickets-cred")},
                {"name": "tickets-json", "url": f"https://{HOST}:{port}/json/mcp", "tools": tools("tickets-json")},
                {"name": "tickets-sse", "url": f"https://{HOST}:{port}/sse/mcp", "tools": tools("tickets-sse")},
                {"name": "tickets-old", "url": f"https://{HOST}:{port}/old/sse", "transport": "sse",
                 "tools": tools("tickets-old")},
                {"name": "rogue", "url": f"https://{ROGUE}:{port}/rogue/mcp", "tools": tools("rogue")},
                {"name": "evil-old", "url": f"https://{EVIL}:{port}/evil/sse", "transport": "sse",
                 "tools": tools("evil-old")},
            ],
        },
    }


@dataclass
class Sandbox:
    id: str
    token: str
    proxy_url: str
    bundle: str

    def ssl(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.bundle)

    def raw(self, **kw: Any) -> httpx.Client:
        """A plain httpx client through the proxy: for the messages the SDK client cannot produce."""
        return httpx.Client(proxy=self.proxy_url, verify=self.ssl(), timeout=15, trust_env=False, **kw)

    def http2(self, **kw: Any) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(proxy=self.proxy_url, verify=self.ssl(), trust_env=False,
                                  timeout=httpx2.Timeout(15, read=15), **kw)


@dataclass
class RemoteWorld:
    mcp: McpWorld
    gw: LoopbackGateway
    dns: DnsServer

    def url(self, kind: str, host: str = HOST) -> str:
        return f"https://{host}:{self.mcp.port}{KINDS[kind]}"

    def admit(self, tenant: str = "acme") -> Sandbox:
        data = self.gw.admit_sandbox({"policy": "mcp-remote", "labels": {"tenant": tenant}})
        return Sandbox(id=data["id"], token=data["token"], proxy_url=data["proxy_url"], bundle=self.gw.bundle)

    def records(self, sandbox: Sandbox, kind: str = "mcp_tool_call", at_least: int = 1, **attrs: Any) -> list[dict]:
        """The sandbox's audit records of `kind` (and `attrs`), once at least `at_least` are written (some
        are written behind the answer) or after 5 s."""
        def found() -> list[dict]:
            return [r for r in self.gw.audit_records() if r.get("egressgate.sandbox.id") == sandbox.id
                    and r.get("egressgate.operation") == kind and all(r.get(k) == v for k, v in attrs.items())]
        wait_for(lambda: len(found()) >= at_least)
        return found()

    @contextlib.asynccontextmanager
    async def client(self, sandbox: Sandbox, kind: str):
        """A real SDK client session (legacy initialize handshake) through the gateway."""
        http = sandbox.http2()
        async with http:
            if kind == "old":
                def factory(headers=None, timeout=None, auth=None):
                    return httpx2.AsyncClient(proxy=sandbox.proxy_url, verify=sandbox.ssl(), trust_env=False,
                                              headers=headers, timeout=timeout or httpx2.Timeout(15), auth=auth)
                transport = sse_client(self.url(kind), timeout=15, sse_read_timeout=15, httpx_client_factory=factory)
            else:
                transport = streamable_http_client(self.url(kind), http_client=http)
            async with Client(transport, mode="legacy", read_timeout_seconds=15) as session:
                yield session


# (tool, arguments, reason, rule id suffix or None, rule as is) -- every call denied for a tenant=acme sandbox
DENIALS: list[tuple[str, dict, str, str | None]] = [
    ("export_tickets", {"project": "acme"}, "mcp_tool_denied", None),  # in no list: default deny
    ("delete_ticket", {"ticket": "T-1"}, "mcp_tool_denied", "/deny[0]"),  # tools.deny
    ("search_tickets", {"project": "acme", "limit": 500}, "mcp_argument_denied", "-search"),  # numeric max
    ("search_tickets", {"project": "acme", "status": "deleted"}, "mcp_argument_denied", "-search"),  # enum
    ("search_tickets", {"project": "acme", "sql": "drop"}, "mcp_argument_denied", "-search"),  # unlisted argument
    ("search_tickets", {"project": "globex"}, "mcp_argument_denied", "-search"),  # cross-tenant (equals_label)
    ("close_ticket", {"ticket": "T-7"}, "approval_required", "-close"),  # approval: required
]


def rule_of(server: str, suffix: str | None) -> str | None:
    if suffix is None:
        return None
    return f"mcp:{server}{suffix}" if suffix.startswith("/") else f"{server}{suffix}"


async def check_denials(rw: RemoteWorld, sbx: Sandbox, kind: str, server: str) -> None:
    """Every DENIALS call through one SDK session: a JSON-RPC error the SDK surfaces (-32001, reason,
    rule, approval id), one deny record each, and not one of them in what the server received."""
    from mcp import MCPError

    mark = rw.mcp.received.mark()
    errors = []
    async with rw.client(sbx, kind) as client:
        for tool, arguments, _reason, _rule in DENIALS:
            try:
                await client.call_tool(tool, arguments)
            except MCPError as exc:
                errors.append(error_of(exc))
            else:
                raise AssertionError(f"{tool}({arguments}) was not denied")
    got = [(e["code"], e["data"]["reason"], e["data"]["rule"], e["data"]["egressgate"]) for e in errors]
    assert got == [(-32001, reason, rule_of(server, rule), True) for _t, _a, reason, rule in DENIALS]
    assert errors[-1]["data"].get("approval_id")  # the approval an operator can grant
    assert rw.mcp.received.tool_calls(mark) == []  # the server never saw one of them
    assert not rw.mcp.received.saw(b"export_tickets", mark) and not rw.mcp.received.saw(b"delete_ticket", mark)
    records = rw.records(sbx, at_least=len(DENIALS))
    assert [(r["egressgate.decision"], r["egressgate.reason"], r["egressgate.mcp.tool"]) for r in records] == [
        ("deny", reason, tool) for tool, _a, reason, _r in DENIALS]


def error_of(exc: BaseException) -> dict:
    """The JSON-RPC error object the SDK surfaced (code, message, data)."""
    error = getattr(exc, "error", None)
    assert error is not None, f"not a JSON-RPC error: {exc!r}"
    return json.loads(error.model_dump_json()) if hasattr(error, "model_dump_json") else dict(error)


def raw_initialize(client: httpx.Client, url: str) -> dict[str, str]:
    """Initialize an MCP session by hand (plain httpx: for bytes the SDK would never send); returns the
    headers every later request of that session carries (its Mcp-Session-Id, the protocol version)."""
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}
    res = client.post(url, json=init, headers=headers)
    assert res.status_code == 200, res.text
    headers["Mcp-Session-Id"] = res.headers["mcp-session-id"]
    headers["MCP-Protocol-Version"] = "2025-11-25"
    assert client.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                       headers=headers).status_code == 202
    return headers


@contextlib.contextmanager
def open_remote_world(tmp: Path) -> Iterator[RemoteWorld]:
    ca = trustme.CA()
    loop = LoopThread()
    dns = DnsServer()
    transport, dns_port = loop.run(start_dns(dns))
    dns.records[HOST] = "127.0.0.1"
    dns.records[EVIL] = "127.0.0.1"
    dns.records[ROGUE] = "127.0.0.1"
    gw = None
    try:
        with serve_mcp(ca, tmp, [HOST, EVIL, ROGUE]) as mcp_world:
            secret_file = tmp / "tickets.secret"
            secret_file.write_text(SECRET + "\n")
            secret_file.chmod(0o600)
            policy_dir = write_policies(tmp / "policies", {"mcp-remote": policy(mcp_world.port, str(secret_file))})
            bundle = tmp / "upstream-ca.pem"
            bundle.write_bytes(ca.cert_pem.bytes())
            config = {
                "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
                "policy": str(policy_dir),
                "var_dir": str(tmp / "var"),
                "upstream": {"resolver": f"127.0.0.1:{dns_port}", "ca_bundle": str(bundle)},
            }
            gw = LoopbackGateway(**launch_loopback(tmp, config))
            try:
                yield RemoteWorld(mcp=mcp_world, gw=gw, dns=dns)
            finally:
                stop_gateway(gw)
            assert_replays_unchanged(gw.var, policy_dir)  # tool calls included (issue 23, item 1)
    finally:
        loop.close((), (), [transport])
