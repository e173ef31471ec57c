"""The explicit proxy's connection guards are in force on the transparent listener too.

A second gateway in the same world, with tight limits (`limits:`), and its own redirected namespace
`tsg` (198.18.6.0/24, tests/support/transparent.py): connguard's header deadline cuts a silent connection, the
bounded ClientHello layer (tls_limits.py) refuses an oversized handshake with an alert, the per-sandbox
connection limit (identity.py) refuses with the deny body, and connections that identified no *live*
sandbox (unknown source, revoked sandbox) count against their source address (connguard.py), so a
revoked sandbox cannot hold an unbounded number of them open. Each refusal is audited.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from tests.networld import World
from tests.support.http1 import parse_response, read_all
from tests.support.launcher import EGRESSGATE
from tests.support.netgateway import Gateway
from tests.support.transparent import UPSTREAM, Transparent

NET = "198.18.6"
HEADER_TIMEOUT = 3.0
LIMITS = {"header_timeout": HEADER_TIMEOUT, "tls_handshake_timeout": HEADER_TIMEOUT,
          "max_client_hello_bytes": 8192, "max_pending_per_source": 3, "max_connections_per_sandbox": 6}
ALERT = b"\x15\x03\x03\x00\x02\x02\x2f"  # fatal illegal_parameter (tls_limits.py)


@pytest.fixture(scope="module")
def guarded(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = Gateway.start(world, tmp_path_factory.mktemp("guarded"), extra_config={"limits": LIMITS})
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def tg(world: World, guarded: Gateway) -> Iterator[Transparent]:
    t = Transparent.create(world, guarded, tag="tsg", net=NET, table="egT_guards")
    try:
        yield t
    finally:
        t.close()


@contextlib.contextmanager
def idle(tg: Transparent, n: int, source: str) -> Iterator[list[socket.socket]]:
    """`n` connections from `source` that send the start of a request and stop (identified by their
    first bytes, then waiting for their header deadline)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):  # one at a time: each is identified before the next is accepted
            socks.append(tg.connect(UPSTREAM, 80, source))
            socks[-1].sendall(b"GET / HTTP/1.1\r\n")
            time.sleep(0.15)
        yield socks
    finally:
        for s in socks:
            s.close()


def get(tg: Transparent, source: str):
    with tg.connect(UPSTREAM, 80, source) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: api.allowed.test\r\nConnection: close\r\n\r\n")
        return parse_response(read_all(sock, 2.0, first=10))


def test_silent_connection_is_cut_at_the_header_deadline(tg: Transparent, guarded: Gateway):
    assert get(tg, f"{NET}.2").status == 200  # positive control: the listener and the sandbox work
    with tg.connect(UPSTREAM, 80) as sock:
        start = time.monotonic()
        sock.settimeout(HEADER_TIMEOUT + 10)
        assert sock.recv(1024) == b""
        took = time.monotonic() - start
    assert HEADER_TIMEOUT - 0.5 < took < HEADER_TIMEOUT + 5, took


def test_oversized_client_hello_gets_an_alert(tg: Transparent, world: World):
    """A record announcing a 16 MiB ClientHello: refused at the announced size (limit 8 KiB)."""
    mark = world.mark()
    hello_head = b"\x01" + (16 * 1024 * 1024 - 1).to_bytes(3, "big")
    body = hello_head + b"\x00" * 4000
    with tg.connect(UPSTREAM, 443) as sock:
        sock.sendall(b"\x16\x03\x01" + struct.pack("!H", len(body)) + body)
        got = read_all(sock, 2.0, first=10)
    assert got == ALERT, got[:100]
    assert world.hits(mark, listener="upstream-tls") == []


def test_per_sandbox_connection_limit(tg: Transparent, guarded: Gateway, world: World):
    """Limit 6: five open connections and a request pass (control); with six open (idle), the next is
    refused with 429 and the deny body, audited with the sandbox id."""
    with idle(tg, 5, f"{NET}.2"):
        assert get(tg, f"{NET}.2").status == 200
    time.sleep(0.3)  # the gateway has seen those closes
    mark = world.mark()
    with idle(tg, 6, f"{NET}.2"):
        resp = get(tg, f"{NET}.2")
    assert resp.status == 429, resp.raw[:300]
    body = resp.json()
    assert body["reason"] == "connection_limit"
    record = guarded.audit_record(body["request_id"])
    assert record["egressgate.sandbox.id"] == tg.sbx.id and record["egressgate.mode"] == "transparent"
    assert record["egressgate.detail"] == "max_connections_per_sandbox"
    assert world.hits(mark, listener="upstream-http") == []


def test_revoked_sandbox_connections_count_against_the_source(tg: Transparent, guarded: Gateway,
                                                               world: World):
    """A live sandbox's open connections do not count against its source (control: four idle ones, over
    max_pending_per_source = 3, and a request pass); a revoked sandbox's do, so with three open the next
    is refused by max_pending_per_source, not answered as just another revoked request."""
    source = f"{NET}.4"
    victim = guarded.admit("escape-transparent", address=source)
    with idle(tg, 4, source):
        assert get(tg, source).status == 200
    res = world.exec(world.gw, EGRESSGATE, "sandbox", "revoke", "--config", str(guarded.config), victim.id)
    assert res.returncode == 0, res.stderr
    time.sleep(0.3)
    assert get(tg, source).json()["reason"] == "sandbox_revoked"
    time.sleep(0.3)
    with idle(tg, 3, source):
        resp = get(tg, source)
    assert resp.status == 429, resp.raw[:300]
    assert resp.json()["reason"] == "connection_limit"
    record = guarded.audit_record(resp.json()["request_id"])
    assert record["egressgate.limit"] == "max_pending_per_source"

