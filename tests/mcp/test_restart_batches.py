"""An MCP session on protocol 2025-03-26 keeps its JSON-RPC batches across a gateway restart (issue 23).

The gateway learned a session's protocol version only from the server's answer to `initialize`. A
restarted gateway never saw that answer, so every batch of a session begun before the restart was refused
`mcp_malformed` (batch_not_supported), though the server had negotiated the one version that has batches.
The version now comes from the request's `MCP-Protocol-Version` header when no initialize was seen, and
batches stay refused on versions without them (and when no version is known at all).

Real parts: the SDK's streamable-HTTP server, a real Redis (admitted sandboxes survive the restart), and
two real `egressgate run` processes one after the other on the same config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import trustme

from tests.mcp.remote_world import HOST, KINDS, policy
from tests.mcp.servers import McpWorld, serve_mcp
from tests.support.launcher import LoopbackGateway, launch_loopback, stop_gateway, write_policies
from tests.support.loopback import DnsServer, LoopThread, start_dns
from tests.support.redis import RedisServer
from tests.support.replay_check import assert_config_replays

CALL = (
    '{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"search_tickets","arguments":{"project":"acme"}}}'
)


@contextlib.contextmanager
def restartable(tmp: Path) -> Iterator[tuple[McpWorld, dict]]:
    """The MCP server and DNS, and the config of a gateway on a real Redis (start it with launch_loopback)."""
    ca = trustme.CA()
    loop = LoopThread()
    dns = DnsServer()
    transport, dns_port = loop.run(start_dns(dns))
    dns.records[HOST] = "127.0.0.1"
    try:
        with RedisServer(tmp / "redis") as redis, serve_mcp(ca, tmp, [HOST]) as mcp_world:
            secret_file = tmp / "tickets.secret"
            secret_file.write_text("sk-restart-secret\n")
            secret_file.chmod(0o600)
            policy_dir = write_policies(tmp / "policies", {"mcp-remote": policy(mcp_world.port, str(secret_file))})
            bundle = tmp / "upstream-ca.pem"
            bundle.write_bytes(ca.cert_pem.bytes())
            yield (
                mcp_world,
                {
                    "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
                    "policy": str(policy_dir),
                    "var_dir": str(tmp / "var"),
                    "upstream": {"resolver": f"127.0.0.1:{dns_port}", "ca_bundle": str(bundle)},
                    "state": {"backend": "redis", "url": redis.url, "key_prefix": redis.prefix()},
                },
            )
    finally:
        loop.close((), (), [transport])


def client(gw: LoopbackGateway, sbx: dict) -> httpx.Client:
    """The sandbox's credentials through `gw`'s proxy port (it changes with each start)."""
    proxy = f"http://{sbx['id']}:{sbx['token']}@127.0.0.1:{gw.proxy[1]}"
    return httpx.Client(proxy=proxy, verify=gw.bundle, timeout=15, trust_env=False)


def initialize(c: httpx.Client, url: str, version: str) -> dict[str, str]:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}},
    }
    res = c.post(url, json=init, headers=headers)
    assert res.status_code == 200 and res.json()["result"]["protocolVersion"] == version, res.text
    headers["Mcp-Session-Id"] = res.headers["mcp-session-id"]
    headers["MCP-Protocol-Version"] = version
    assert (
        c.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers).status_code == 202
    )
    return headers


def batch(c: httpx.Client, url: str, headers: dict[str, str], rid: int) -> httpx.Response:
    return c.post(url, content=("[" + CALL % rid + "]").encode(), headers=headers)


def refused_batch(res: httpx.Response) -> bool:
    """The gateway's refusal of a batch (the server's own answer to a batch it forwarded is something else:
    the SDK server answers 400 without the gateway's `data.reason`)."""
    body = res.json() if res.headers.get("content-type", "").startswith("application/json") else None
    error = body.get("error") if isinstance(body, dict) else None
    return (
        res.status_code == 400
        and isinstance(error, dict)
        and (error.get("data") or {}).get("reason") == "mcp_malformed"
        and "no JSON-RPC batches" in error.get("message", "")
    )


def test_a_2025_03_26_session_keeps_its_batches_across_a_gateway_restart(tmp_path: Path) -> None:
    with restartable(tmp_path) as (mcp, config):
        url = f"https://{HOST}:{mcp.port}{KINDS['json']}"
        (tmp_path / "gw").mkdir()
        gw = LoopbackGateway(**launch_loopback(tmp_path / "gw", {**config}))
        try:
            sbx = gw.admit_sandbox({"policy": "mcp-remote", "labels": {"tenant": "acme"}})
            with client(gw, sbx) as c:
                old = initialize(c, url, "2025-03-26")
                new = initialize(c, url, "2025-11-25")
                mark = mcp.received.mark()
                before = batch(c, url, old, 1)  # control: the gateway saw initialize, the batch goes through
                assert not refused_batch(before), before.text
                assert mcp.received.tool_calls(mark) == [("search_tickets", {"project": "acme"})]
                assert refused_batch(batch(c, url, new, 2))  # control: 2025-11-25 has no batches
        finally:
            assert stop_gateway(gw) == 0
        gw = LoopbackGateway(**launch_loopback(tmp_path / "gw", {**config}))  # same var dir, same Redis
        try:
            with client(gw, sbx) as c:
                mark = mcp.received.mark()
                after = batch(c, url, old, 3)
                assert not refused_batch(after), after.text  # before the fix: refused, version unknown
                assert mcp.received.tool_calls(mark) == [("search_tickets", {"project": "acme"})]
                # still refused: a session on a version without batches, and one that names no version
                mark = mcp.received.mark()
                assert refused_batch(batch(c, url, new, 4))
                unnamed = {k: v for k, v in old.items() if k != "MCP-Protocol-Version"}
                assert refused_batch(batch(c, url, unnamed, 5))
                assert mcp.received.bodies(mark) == []
                one = c.post(url, content=(CALL % 6).encode(), headers=unnamed)  # control: the session serves
                assert one.status_code == 200 and "5 open tickets in acme" in one.text, one.text
        finally:
            assert stop_gateway(gw) == 0
        assert_config_replays(tmp_path / "gw" / "gateway.yaml")
