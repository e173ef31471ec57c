"""Connection deadlines and limits (`limits:` in the gateway config, gateway/pipeline/connguard.py) with real
sockets against a real gateway process.

Before: mitmproxy closed a connection only after 600 s of *inactivity*, so slow-loris connections (one
header byte now and then) and stalled TLS handshakes stayed open indefinitely, and one source could open
as many as it liked. Every test has a positive control: normal requests keep working meanwhile, and a
connection within the limit is served.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time

import pytest

from tests.support.gwworld import auth, connection_records, dial, start_gateway
from tests.support.http1 import read_reply
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for

FAST = {"header_timeout": 2.0, "tls_handshake_timeout": 2.0, "keepalive_timeout": 2.0,
        "audit_per_second": 3}
SMALL = {"max_pending_per_source": 8, "max_connections_per_sandbox": 4}


@pytest.fixture(scope="module")
def gw_fast(gateway, tmp_path_factory):
    gw = start_gateway(gateway.world, tmp_path_factory.mktemp("gwfast"), {"limits": FAST})
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="module")
def gw_small(gateway, tmp_path_factory):
    gw = start_gateway(gateway.world, tmp_path_factory.mktemp("gwsmall"), {"limits": SMALL})
    yield gw
    stop_gateway(gw)


def closed(sock: socket.socket, timeout: float = 0.05) -> bool:
    """True once the gateway closed the connection (EOF or RST); data is read and ignored."""
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


def events(records: list[dict]) -> int:
    """Individual records count 1; a summary record counts the events folded into it."""
    return sum(int(r.get("egressgate.suppressed") or 1) for r in records)


def normal_request_ok(gw, sbx) -> bool:
    with sbx.client() as c:
        return c.get(sbx.url("api.test", "/echo")).status_code == 200


class Dripper:
    """Slow loris: each socket sends one more header byte every `every` seconds, never the end."""

    def __init__(self, socks: list[socket.socket], every: float = 0.2) -> None:
        self.socks = socks
        self.every = every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(self.every):
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.send(b"x")

    def __enter__(self) -> Dripper:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)


def test_slowloris_closed_after_header_timeout_and_audited(gw_fast):
    gw = gw_fast
    sbx = gw.admit("gw-basic")
    target = f"http://api.test:{gw.world.http_port}/echo"
    before = events(connection_records(gw, "header_timeout"))
    socks = []
    started = time.monotonic()
    for i in range(60):  # from three source addresses
        s = dial(gw, f"127.0.0.{20 + i % 3}")
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: api.test\r\nX-Slow: ".encode())
        socks.append(s)
    last_dialed = time.monotonic()
    with Dripper(socks):
        time.sleep(0.5)
        assert not closed(socks[-1], 0.01)  # open while within the deadline (and bytes keep coming)
        assert normal_request_ok(gw, sbx)  # positive control: the gateway serves others meanwhile
        assert wait_for(lambda: all(closed(s, 0.01) for s in socks), timeout=10)
    assert time.monotonic() - started >= FAST["header_timeout"] - 0.1
    assert time.monotonic() - last_dialed < FAST["header_timeout"] + 6
    assert normal_request_ok(gw, sbx)
    for s in socks:
        s.close()
    # every event is in the audit trail: 3 records/s per source individually, the rest in summaries
    assert wait_for(lambda: events(connection_records(gw, "header_timeout")) - before == 60, timeout=5)
    records = connection_records(gw, "header_timeout")
    assert any(r.get("egressgate.suppressed") for r in records)
    assert all(r.get("egressgate.decision") == "deny" and r.get("client.address", "").startswith("127.0.0.")
               for r in records)
    assert any("limits.header_timeout" in (r.get("egressgate.message") or "") for r in records)


def test_silent_connection_closed_after_header_timeout(gw_fast):
    """A connection that sends nothing at all is closed too (it holds a socket just the same)."""
    s = dial(gw_fast, "127.0.0.30")
    time.sleep(0.3)
    assert not closed(s)
    assert wait_for(lambda: closed(s, 0.01), timeout=5)
    s.close()


def test_stalled_tls_handshake_closed_and_audited(gw_fast):
    gw = gw_fast
    sbx = gw.admit("gw-basic")
    target = f"api.test:{gw.world.https_port}"
    stalled = []
    for _ in range(3):
        s = dial(gw)
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth(sbx)}\r\n".encode())
        status, _, _ = read_reply(s)
        assert status == 200
        s.send(b"\x16\x03\x01\x02\x00\x01")  # the first bytes of a ClientHello, then nothing
        stalled.append(s)
    time.sleep(0.3)
    assert not closed(stalled[-1], 0.01)
    assert normal_request_ok(gw, sbx)  # positive control: a complete handshake through the same gateway
    assert wait_for(lambda: all(closed(s, 0.01) for s in stalled), timeout=8)
    assert wait_for(lambda: len([r for r in connection_records(gw, "tls_handshake_timeout")
                                 if r.get("egressgate.sandbox.id") == sbx.id]) == 3, timeout=5)


def test_keepalive_slowloris_on_second_request(gw_fast):
    """After one complete request, the next request's headers are bounded too (keepalive_timeout); an
    idle kept-alive connection is closed quietly (no audit record)."""
    gw = gw_fast
    sbx = gw.admit("gw-basic")
    target = f"http://api.test:{gw.world.http_port}/echo"
    request = f"GET {target} HTTP/1.1\r\nHost: api.test:{gw.world.http_port}\r\n{auth(sbx)}\r\n".encode()
    before = events([r for r in connection_records(gw, "header_timeout")
                     if r.get("egressgate.sandbox.id") == sbx.id])
    slow, idle = dial(gw, "127.0.0.31"), dial(gw, "127.0.0.32")
    for s in (slow, idle):
        s.sendall(request)
        status, _headers, body = read_reply(s)
        assert status == 200 and json.loads(body)["path"] == "/echo"
    slow.sendall(b"GET " + target.encode() + b" HTTP/1.1\r\nHost: api")
    with Dripper([slow], every=0.3):
        time.sleep(0.5)
        assert not closed(slow, 0.01) and not closed(idle, 0.01)
        assert wait_for(lambda: closed(slow, 0.01) and closed(idle, 0.01), timeout=8)
    assert wait_for(lambda: events([r for r in connection_records(gw, "header_timeout")
                                    if r.get("egressgate.sandbox.id") == sbx.id]) - before == 1, timeout=5)
    recs = [r for r in connection_records(gw, "header_timeout") if r.get("egressgate.sandbox.id") == sbx.id]
    assert recs[-1]["client.address"] == "127.0.0.31"
    assert "limits.keepalive_timeout" in recs[-1]["egressgate.message"]


def test_keepalive_deadline_follows_the_last_response(gw_fast):
    """connguard keeps one timer per connection and moves a deadline by timestamp (the timer re-arms
    itself when it fires early): a kept-alive connection busy for longer than every timeout is never cut
    while it keeps sending requests, and once it stalls, the keep-alive deadline counts from its *last*
    response — not from the accept or an earlier response, and not never."""
    gw = gw_fast
    sbx = gw.admit("gw-basic")
    target = f"http://api.test:{gw.world.http_port}/echo"
    request = f"GET {target} HTTP/1.1\r\nHost: api.test:{gw.world.http_port}\r\n{auth(sbx)}\r\n".encode()
    s = dial(gw, "127.0.0.33")
    started = time.monotonic()
    while time.monotonic() - started < 2.5 * FAST["keepalive_timeout"]:  # past the accept's header deadline
        s.sendall(request)
        status, _headers, body = read_reply(s)
        assert status == 200 and json.loads(body)["path"] == "/echo"  # positive control: served throughout
        time.sleep(0.6 * FAST["keepalive_timeout"])
    s.sendall(request)
    assert read_reply(s)[0] == 200
    last_response = time.monotonic()
    s.sendall(b"GET " + target.encode() + b" HTTP/1.1\r\nHost: api")  # then stalls mid-head
    assert wait_for(lambda: closed(s, 0.01), timeout=FAST["keepalive_timeout"] + 6)
    waited = time.monotonic() - last_response
    s.close()
    assert FAST["keepalive_timeout"] - 0.1 <= waited < FAST["keepalive_timeout"] + 6
    assert wait_for(lambda: any(r.get("client.address") == "127.0.0.33"
                                and "limits.keepalive_timeout" in (r.get("egressgate.message") or "")
                                for r in connection_records(gw, "header_timeout")), timeout=5)


def test_per_source_limit_refuses_n_plus_1(gw_small):
    gw = gw_small
    n = SMALL["max_pending_per_source"]
    sbx = gw.admit("gw-basic")
    held = [dial(gw, "127.0.0.40") for _ in range(n)]
    time.sleep(0.3)
    assert not any(closed(s) for s in held)  # positive control: N connections are accepted and kept
    extra = dial(gw, "127.0.0.40")
    extra.sendall(b"GET http://api.test/ HTTP/1.1\r\nHost: api.test\r\n\r\n")
    status, headers, body = read_reply(extra)
    assert status == 429 and headers.get("x-egressgate-decision") == "deny"
    data = json.loads(body)
    assert data["reason"] == "connection_limit"
    assert wait_for(lambda: closed(extra, 0.01), timeout=5)
    # other sources are not affected, and the held connections still work
    other = dial(gw, "127.0.0.41")
    target = f"http://api.test:{gw.world.http_port}/echo"
    other.sendall(f"GET {target} HTTP/1.1\r\nHost: api.test:{gw.world.http_port}\r\n{auth(sbx)}\r\n".encode())
    assert read_reply(other)[0] == 200
    held[0].sendall(f"GET {target} HTTP/1.1\r\nHost: api.test:{gw.world.http_port}\r\n{auth(sbx)}\r\n".encode())
    assert read_reply(held[0])[0] == 200
    # held[0] identified a sandbox: it no longer counts against the source, so one more is accepted
    again = dial(gw, "127.0.0.40")
    time.sleep(0.3)
    assert not closed(again)
    for s in (*held, extra, other, again):
        s.close()
    assert wait_for(lambda: len([r for r in connection_records(gw, "connection_limit")
                                 if r.get("client.address") == "127.0.0.40"]) == 1, timeout=5)
    assert next(r for r in connection_records(gw, "connection_limit")
            if r.get("client.address") == "127.0.0.40")["egressgate.request.id"] == data["request_id"]


def test_per_sandbox_limit_refuses_n_plus_1(gw_small):
    gw = gw_small
    n = SMALL["max_connections_per_sandbox"]
    sbx, other = gw.admit("gw-basic"), gw.admit("gw-basic")
    target = f"api.test:{gw.world.https_port}"
    connect = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth(sbx)}\r\n".encode()
    tunnels = []
    for _ in range(n):
        s = dial(gw)
        s.sendall(connect)
        assert read_reply(s)[0] == 200
        tunnels.append(s)
    refused = dial(gw)
    refused.sendall(connect)
    status, _, body = read_reply(refused)
    assert status == 429 and json.loads(body)["reason"] == "connection_limit"
    refused.close()
    # positive controls: the N tunnels work, another sandbox is not affected
    ctx = ssl.create_default_context(cafile=gw.bundle)
    tls = ctx.wrap_socket(tunnels[0], server_hostname="api.test")
    tls.sendall(b"GET /echo HTTP/1.1\r\nHost: " + target.encode() + b"\r\n\r\n")
    assert read_reply(tls)[0] == 200
    assert normal_request_ok(gw, other)
    # closing one frees a slot
    tls.close()
    time.sleep(0.3)
    again = dial(gw)
    again.sendall(connect)
    assert read_reply(again)[0] == 200
    for s in (*tunnels[1:], again):
        s.close()
    denied = [r for r in gw.audit_records() if r.get("egressgate.operation") == "connect"
              and r.get("egressgate.sandbox.id") == sbx.id and r.get("egressgate.reason") == "connection_limit"]
    assert len(denied) == 1


def test_oversized_request_head_refused_431_and_audited(gw_fast):
    """mitmproxy buffered request-head bytes without limit (300 MB on one connection grew the gateway by
    300 MB). Over limits.max_header_bytes: 431 header_too_large, closed, audited — on the proxy
    connection and inside a TLS tunnel. Positive control: 30 kB of headers pass."""
    gw = gw_fast
    sbx = gw.admit("gw-basic")
    with sbx.client() as c:
        big = {f"X-Big-{i}": "b" * 6000 for i in range(5)}  # 30 kB (the upstream allows 8 kB per line)
        res = c.get(sbx.url("api.test", "/echo"), headers=big)
        assert res.status_code == 200 and res.json()["headers"]["x-big-4"] == "b" * 6000
    s = dial(gw, "127.0.0.33")
    s.sendall(f"GET http://api.test:{gw.world.http_port}/echo HTTP/1.1\r\nHost: api.test\r\nX-Big: ".encode())
    status, _, body = (0, None, b"")
    try:
        for _ in range(64):  # 4 MiB at most; the gateway answers and closes long before
            s.sendall(b"a" * 65536)
    except OSError:
        pass
    status, headers, body = read_reply(s)
    assert status == 431 and headers.get("x-egressgate-decision") == "deny"
    assert json.loads(body)["reason"] == "header_too_large"
    assert closed(s, 2)
    s.close()
    # inside a TLS tunnel (identified sandbox)
    target = f"api.test:{gw.world.https_port}"
    t = dial(gw)
    t.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth(sbx)}\r\n".encode())
    assert read_reply(t)[0] == 200
    tls = ssl.create_default_context(cafile=gw.bundle).wrap_socket(t, server_hostname="api.test")
    tls.sendall(b"GET /echo HTTP/1.1\r\nHost: " + target.encode() + b"\r\nX-Big: " + b"a" * (100 * 1024))
    status, _, body = read_reply(tls)
    assert status == 431 and json.loads(body)["reason"] == "header_too_large"
    tls.close()
    assert wait_for(lambda: len(connection_records(gw, "header_too_large")) == 2, timeout=5)
    recs = connection_records(gw, "header_too_large")
    assert {r.get("egressgate.sandbox.id") for r in recs} == {None, sbx.id}
    assert normal_request_ok(gw, sbx)


def test_slow_reader_of_a_large_response_is_not_cut(gw_fast):
    """The keep-alive deadline starts at the response hook, which runs once the upstream body is read,
    while the tail of it may still wait in the gateway's write buffer: a client that pauses near the end
    of a large response for longer than keepalive_timeout is slow, not idle, and must get all of it."""
    gw = gw_fast
    sbx = gw.admit("gw-basic")
    size = 8_000_000
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.bind(("127.0.0.34", 0))
    s.connect(gw.proxy)
    target = f"http://api.test:{gw.world.http_port}/big?n={size}"
    s.sendall(f"GET {target} HTTP/1.1\r\nHost: api.test:{gw.world.http_port}\r\n{auth(sbx)}\r\n".encode())
    s.settimeout(10)
    data = bytearray()  # a small receive buffer: thousands of short reads (bytes += would copy it all each time)
    while len(data) < size - 1_500_000:  # read most of it, then stop reading for a while
        chunk = s.recv(1 << 20)
        assert chunk
        data += chunk
    time.sleep(FAST["keepalive_timeout"] * 2.5)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    while len(body) < size:
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        body += chunk
    assert len(body) == size
    s.close()
