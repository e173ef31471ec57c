"""Byte budgets on the transparent listener's non-credential paths (raw TCP relayed by a tcp rule, plain
HTTP named by its Host), each next to its explicit-proxy control. The credential, phantom, rule-budget
and WebSocket paths are in tests/gateway_credentials/test_transparent.py.

`tby` (198.18.7.0/24, tests/support/transparent.py) has its TCP DNATed to the gateway's transparent listener;
each test admits an escape-transparent-budget sandbox (outbound_bytes_max 2000) at its own source address
there, and the explicit control runs the same exchange from the world's `sbx` namespace through the proxy.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator

import pytest

import tests.networld as nw
from tests.escape.checks import SETTLE, requests_on
from tests.networld import World
from tests.support.http1 import read_all, read_response
from tests.support.netgateway import Gateway, Sandbox
from tests.support.transparent import UPSTREAM, Transparent

pytestmark = pytest.mark.netns

NET = "198.18.7"
POLICY = "escape-transparent-budget"
BUDGET = 2000
_SOURCES = itertools.count(10)


@pytest.fixture(scope="module")
def tby(world: World, gateway: Gateway) -> Iterator[Transparent]:
    t = Transparent.create(world, gateway, tag="tby", net=NET, table="egB_tbytes")
    try:
        yield t
    finally:
        t.close()


def fresh_unbound(gateway: Gateway) -> Sandbox:
    """A fresh sandbox for the explicit proxy, admitted without an address: its token is then not bound
    to one (the proxy is reached from the sandbox namespace's own address, not from a NET one)."""
    gateway.sandboxes.pop(POLICY, None)
    return gateway.admit(POLICY)


def open_raw(tby: Transparent, gateway: Gateway, path: str) -> socket.socket:
    """A raw TCP stream to 198.18.1.10:2222 for a fresh sandbox: DNATed (transparent) or CONNECTed."""
    if path == "transparent":
        source = f"{NET}.{next(_SOURCES)}"
        nw.sh("ip", "-n", tby.ns, "addr", "add", f"{source}/32", "dev", f"{nw.PREFIX}{tby.world.sid}tbyb")
        gateway.admit(POLICY, address=source)
        return tby.connect(UPSTREAM, 2222, source)
    sbx = fresh_unbound(gateway)
    sock, resp = gateway.tunnel(sbx, f"{UPSTREAM}:2222")
    assert resp.status == 200, resp.raw[:300]
    return sock


def _raw_sizes(world: World, mark) -> list[int]:
    time.sleep(SETTLE)
    return [h["size"] for h in world.hits(mark, listener="upstream-raw") if h["event"] == "data"]


@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_raw_tcp_over_budget_is_cut(tby: Transparent, world: World, gateway: Gateway, path: str) -> None:
    """1500 bytes fit the 2000-byte budget and are relayed (control); the next 1000 would cross it:
    they are not relayed and the connection is cut."""
    mark = world.mark()
    with open_raw(tby, gateway, path) as sock:
        sock.sendall(b"a" * 1500)
        assert read_all(sock, 1.0, first=10).startswith(b"RAW-ACK 1500")
        try:
            sock.sendall(b"b" * 1000)
            reply = read_all(sock, 1.0, first=5)
        except OSError:
            reply = b""
    assert b"RAW-ACK" not in reply, reply
    assert sum(_raw_sizes(world, mark)) == 1500


@pytest.mark.parametrize("path", ["explicit", "transparent"])
def test_plain_http_upload_over_budget_is_refused(tby: Transparent, world: World, gateway: Gateway,
                                                  path: str) -> None:
    source = f"{NET}.{next(_SOURCES)}"
    mark = world.mark()
    body = b"x" * (BUDGET + 1)
    head = (f"POST /big HTTP/1.1\r\nHost: api.allowed.test\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n")
    if path == "transparent":
        nw.sh("ip", "-n", tby.ns, "addr", "add", f"{source}/32", "dev", f"{nw.PREFIX}{tby.world.sid}tbyb")
        gateway.admit(POLICY, address=source)
        sock = tby.connect(UPSTREAM, 80, source)
        request = (head + "\r\n").encode() + body
    else:
        sbx = fresh_unbound(gateway)
        sock = gateway.connect()
        request = (head.replace("POST /big", "POST http://api.allowed.test/big")
                   + f"Proxy-Authorization: {sbx.auth_header}\r\n\r\n").encode() + body
    with sock:
        sock.sendall(request)
        resp = read_response(sock)
    assert resp.status == 429 and resp.json()["reason"] == "budget_exceeded", resp.raw[:400]
    record = gateway.audit_record(resp.json()["request_id"])
    assert record["egressgate.reason"] == "budget_exceeded"
    assert (record.get("egressgate.mode") == "transparent") == (path == "transparent"), record
    assert requests_on(world, mark, "upstream-http") == []
