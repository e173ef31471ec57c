"""The client's TLS ClientHello is bounded (`limits.max_client_hello_bytes`, gateway/layers/tls_limits.py), with
real sockets against a real gateway process (default limits: 64 KiB).

Before: mitmproxy buffered a ClientHello of up to 16 MiB (24-bit length over any number of records) and
re-joined and re-parsed the whole buffer on every read, for up to `tls_handshake_timeout`: memory and
the single event loop's CPU grew quadratically, for every sandbox. Positive control: a legal 20 KiB
ClientHello, fragmented over many records and reads, still completes its handshake and its request.
"""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import struct
import threading
import time

from mitmproxy.proxy.layers import tls as tls_parse

from tests.support.gwworld import auth, connection_records, dial
from tests.support.http1 import read_all, read_reply
from tests.support.waiting import wait_for

LIMIT = 64 * 1024  # the default
ONE_READ = 65535  # mitmproxy's read size
ALERT = b"\x15\x03\x03\x00\x02\x02\x2f"  # fatal illegal_parameter


def connect_tunnel(gw, sbx, source: str) -> socket.socket:
    target = f"api.test:{gw.world.https_port}"
    s = dial(gw, source)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth(sbx)}\r\n".encode())
    assert read_reply(s)[0] == 200
    return s


def record(body: bytes) -> bytes:
    return b"\x16\x03\x01" + struct.pack("!H", len(body)) + body


class Streamer(threading.Thread):
    """Sends `chunks` until the gateway closes the connection; counts what the kernel accepted."""

    def __init__(self, sock: socket.socket, first: bytes, chunk: bytes, total: int) -> None:
        super().__init__(daemon=True)
        self.sock, self.first, self.chunk, self.total = sock, first, chunk, total
        self.sent = 0
        self.error: OSError | None = None

    def run(self) -> None:
        try:
            self.sock.sendall(self.first)
            self.sent = len(self.first)
            while self.sent < self.total:
                self.sock.sendall(self.chunk)
                self.sent += len(self.chunk)
        except OSError as e:
            self.error = e


def latency(sbx) -> float:
    start = time.monotonic()
    with sbx.client() as c:
        assert c.get(sbx.url("api.test", "/echo")).status_code == 200
    return time.monotonic() - start


def buffered(rec: dict) -> int:
    m = re.search(r"(\d+) bytes of records buffered", str(rec))
    assert m, rec
    return int(m.group(1))


def real_client_hello(alpn: list[str]) -> bytes:
    """The handshake bytes (no record headers) of a ClientHello produced by the real OpenSSL client."""
    ctx = ssl.create_default_context()
    ctx.set_alpn_protocols(alpn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="api.test")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    records, hello, off = outgoing.read(), b"", 0
    while off < len(records):
        size = struct.unpack("!H", records[off + 3:off + 5])[0]
        hello += records[off + 5:off + 5 + size]
        off += 5 + size
    return hello


def test_hello_scan_agrees_with_mitmproxy_parser():
    """The incremental scan says "complete" at exactly the prefix at which mitmproxy's own parser first
    finds the ClientHello, however records and reads are split; the re-framed buffer parses to the same
    ClientHello with the trailing bytes kept; a non-handshake record is invalid."""
    from egressgate.gateway.layers.tls_limits import HelloScan  # here: the other tests also run on the old code
    hello = real_client_hello(["h2", "http/1.1"] + [f"p{i}" * 20 for i in range(40)])
    sizes = [1, 2, 3, 1, 7, 100, 1, 1000, 5, 4000]
    records, i, k = b"", 0, 0
    while i < len(hello):
        records += record(hello[i:i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    stream = records + b"\x14\x03\x03\x00\x01\x01"  # a ChangeCipherSpec record after it
    for step in (1, 3, 64, 1500):
        scan, buf, first = HelloScan(), bytearray(), None
        for pos in range(0, len(stream), step):
            buf += stream[pos:pos + step]
            scan.feed(buf)
            if first is None and tls_parse.get_client_hello(bytes(buf)) is not None:
                first = len(buf)
            assert scan.complete == (first is not None), (step, len(buf))
            if scan.complete:
                break
        assert scan.announced == len(hello) and not scan.invalid
        framed = scan.reframed(buf)
        assert framed.endswith(bytes(buf[len(records):]))
        assert tls_parse.get_client_hello(bytes(framed)) == hello
        assert tls_parse.parse_client_hello(bytes(framed)).alpn_protocols[:2] == [b"h2", b"http/1.1"]
    bad = HelloScan()
    bad.feed(bytearray(record(hello[:10]) + b"\x17\x03\x03\x00\x05hello"))
    assert bad.invalid and not bad.complete


def test_oversized_client_hello_closed_with_alert_and_audited(gateway):
    """Three tunnels each send a record announcing a 16 MiB ClientHello and stream 16 KiB records behind
    it: each is closed with a TLS alert as soon as the announced length is read, and a concurrent normal
    request stays fast. (Old code: all 16 MiB of each were accepted, the growing buffer re-joined and
    re-parsed on every read; the concurrent request took 2.6 s instead of 0.05 s, and the next CONNECT
    timed out.) One audit record per connection, with the sandbox."""
    gw = gateway
    sbx = gw.admit("gw-basic")
    baseline = latency(sbx)
    hello = b"\x01\xff\xff\xfc" + b"\x03\x03" + b"r" * 32  # handshake header: 16 MiB - 4
    first = b"\x16\x03\x01\x40\x00" + hello + b"p" * (16384 - len(hello))
    socks = [connect_tunnel(gw, sbx, "127.0.0.71") for _ in range(3)]
    streamers = [Streamer(s, first, record(b"p" * 16384), 16 * 1024 * 1024) for s in socks]
    for streamer in streamers:
        streamer.start()
    during = latency(sbx)
    start = time.monotonic()
    data = [read_all(s, 10) for s in socks]
    took = time.monotonic() - start
    for streamer in streamers:
        streamer.join(10)
    print(f"latency {baseline:.3f}s before, {during:.3f}s during; clients sent "
          f"{[st.sent for st in streamers]} bytes; got {data[0][:16]!r}; all closed after {took:.3f}s")
    assert data == [ALERT] * 3  # a fatal TLS alert, then EOF/RST
    assert all(not st.is_alive() and st.sent < 16 * 1024 * 1024 for st in streamers)
    for s in socks:
        s.close()
    assert during < baseline + 1.0, (baseline, during)  # old code: 0.05 s -> 2.6 s
    assert wait_for(lambda: len([r for r in connection_records(gw, "client_hello_too_large")
                                 if "127.0.0.71" in str(r)]) == 3, timeout=5)
    recs = [r for r in connection_records(gw, "client_hello_too_large") if "127.0.0.71" in str(r)]
    assert {r.get("egressgate.sandbox.id") for r in recs} == {sbx.id}
    assert {r.get("egressgate.limit") for r in recs} == {"max_client_hello_bytes"}
    assert all("announced 16777216 bytes" in str(r) and buffered(r) <= ONE_READ for r in recs)


def test_client_hello_in_tiny_records_bounded_by_buffered_bytes(gateway):
    """A ClientHello announcing a legal 60 000 bytes, sent in 1-byte records (6 bytes of records per
    byte of hello): the records buffered are bounded too, closed after at most the limit + one read."""
    gw = gateway
    sbx = gw.admit("gw-basic")
    s = connect_tunnel(gw, sbx, "127.0.0.72")
    head = b"".join(record(bytes([b])) for b in b"\x01\x00\xea\x5c")  # announces 60 000 + 4
    streamer = Streamer(s, head, b"".join(record(b"x") for _ in range(4096)), 400 * 1024)
    streamer.start()
    data = read_all(s, 10)
    streamer.join(10)
    print(f"tiny records: client sent {streamer.sent} bytes; got {data[:16]!r}")
    assert data == ALERT
    s.close()
    assert wait_for(lambda: [r for r in connection_records(gw, "client_hello_too_large")
                             if "127.0.0.72" in str(r)], timeout=5)
    rec = next(r for r in connection_records(gw, "client_hello_too_large") if "127.0.0.72" in str(r))
    assert LIMIT < buffered(rec) <= LIMIT + ONE_READ, rec


def test_large_legal_client_hello_over_many_records_still_works(gateway):
    """Positive control: a real ClientHello of ~20 KiB (a long ALPN list), re-fragmented into 1 000-byte
    records and sent in pieces over many reads, completes the handshake and the request."""
    gw = gateway
    sbx = gw.admit("gw-basic")
    s = connect_tunnel(gw, sbx, "127.0.0.73")
    ctx = ssl.create_default_context(cafile=gw.bundle)
    ctx.set_alpn_protocols([f"x-{i:03d}-" + "a" * 200 for i in range(100)] + ["http/1.1"])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="api.test")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    records = outgoing.read()
    hello = b""
    off = 0
    while off < len(records):
        size = struct.unpack("!H", records[off + 3:off + 5])[0]
        hello += records[off + 5:off + 5 + size]
        off += 5 + size
    assert 20_000 < len(hello) < LIMIT
    fragmented = b"".join(record(hello[i:i + 1000]) for i in range(0, len(hello), 1000))
    for i in range(0, len(fragmented), 1500):  # 1 500-byte writes: record headers straddle the reads
        s.sendall(fragmented[i:i + 1500])
        time.sleep(0.002)
    s.settimeout(10)
    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            if out := outgoing.read():
                s.sendall(out)
            data = s.recv(65536)
            assert data, "gateway closed the connection during a legal handshake"
            incoming.write(data)
    s.sendall(outgoing.read())
    tls.write(b"GET /echo HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
    s.sendall(outgoing.read())
    response = b""
    while b"\r\n\r\n" not in response:
        try:
            response += tls.read(65536)
        except ssl.SSLWantReadError:
            data = s.recv(65536)
            assert data
            incoming.write(data)
    assert response.startswith(b"HTTP/1.1 200"), response[:200]
    s.close()
    assert not [r for r in connection_records(gw, "client_hello_too_large") if "127.0.0.73" in str(r)]


def test_oversized_client_hello_on_the_proxy_connection_itself(gateway):
    """The proxy listener also speaks TLS (an HTTPS proxy: http_limits.explicit_http_proxy): the same
    bound holds there, before any sandbox is identified (the record has no sandbox id)."""
    gw = gateway
    s = dial(gw, "127.0.0.74")
    hello = b"\x01\xff\xff\xfc" + b"\x03\x03" + b"r" * 32
    streamer = Streamer(s, b"\x16\x03\x01\x40\x00" + hello + b"p" * (16384 - len(hello)),
                        record(b"p" * 16384), 16 * 1024 * 1024)
    streamer.start()
    data = read_all(s, 10)
    streamer.join(10)
    assert data == ALERT and not streamer.is_alive()
    s.close()
    assert wait_for(lambda: [r for r in connection_records(gw, "client_hello_too_large")
                             if "127.0.0.74" in str(r)], timeout=5)
    rec = next(r for r in connection_records(gw, "client_hello_too_large") if "127.0.0.74" in str(r))
    assert rec.get("egressgate.sandbox.id") is None and buffered(rec) <= ONE_READ
