"""Unbounded HTTP/1 framing buffers (issue 9, siblings of item 9), through the real gateway.

mitmproxy's HTTP/1 client buffered an upstream's unfinished response head without limit, and h11's
chunked reader (used directly, outside h11's own size limit) an unfinished chunk-size line, in both
directions: one endless header or chunk-extension line grew the gateway by every byte the peer sent.
Each test sends 32 MiB of one line against a 64 KiB (head) or 4 KiB (chunk line) bound, with raw
sockets on both sides, and checks that the gateway refused after at most the bound plus one read: the
sender is cut off long before 32 MiB, the gateway's RSS does not grow by the bytes sent, the client
gets the refusal (deny contract), the outcome record says why. Positive controls: a head / chunk line
just under the bound passes intact.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import h11
import pytest
import yaml

from tests.support.gwworld import start_gateway
from tests.support.http1 import read_reply
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for

ENDLESS = 32 << 20  # what a hostile peer tries to make the gateway hold
STEP = 64 << 10
HOST = "hostile.test"


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def send_endless(sock: socket.socket, first: bytes, progress: dict | None = None) -> int:
    """Send `first`, then up to ENDLESS filler bytes; returns how many were accepted before the peer
    closed or stopped reading (a gateway without a bound accepts them all). `progress["sent"]` follows."""
    sock.sendall(first)
    sent, block = 0, b"a" * STEP
    progress = {} if progress is None else progress
    try:
        while sent < ENDLESS:
            sock.sendall(block)
            sent += STEP
            progress["sent"] = sent
    except OSError:
        pass
    return sent


def closed_soon(sock: socket.socket, timeout: float = 5) -> bool:
    """True once the gateway closed the connection (EOF or reset); what still arrives is ignored."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


def settled(progress: dict, key: str = "sent") -> int:
    """The sender's count once it stopped growing (refused: the gateway closed or stopped reading)."""
    last = -1
    while progress.get(key, 0) != last:
        last = progress.get(key, 0)
        time.sleep(0.5)
    return last


class HostileUpstream:
    """A plain-HTTP upstream on 127.0.0.1 that answers by path; records what each request got."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.seen: dict[str, dict] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        h = h11.Connection(h11.SERVER)
        path, body_len, complete = "", 0, False
        conn.settimeout(20)
        with conn:
            try:
                while not complete:
                    event = h.next_event()
                    if event is h11.NEED_DATA:
                        data = conn.recv(65536)
                        if not data:
                            break
                        h.receive_data(data)
                    elif isinstance(event, h11.Request):
                        path = event.target.decode()
                    elif isinstance(event, h11.Data):
                        body_len += len(event.data)
                    elif isinstance(event, h11.EndOfMessage):
                        complete = True
            except (OSError, h11.ProtocolError):
                pass
            record = self.seen.setdefault(path, {})
            record.update(complete=complete, body_len=body_len)
            if not complete:
                return
            record["done"] = self._answer(conn, path, record)

    @staticmethod
    def _answer(conn: socket.socket, path: str, record: dict) -> int:
        if path == "/endless-head":
            return send_endless(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Endless: ", record)
        if path == "/head-under":  # 60 kB of headers: under the 64 KiB bound
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * 60000 + b"\r\nContent-Length: 2\r\n\r\nok")
        elif path == "/endless-chunk":
            return send_endless(conn, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                      b"5\r\nhello\r\n5;x=", record)
        elif path == "/chunk-under":  # a chunk line of 4006 bytes: under the 4 KiB bound
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=" + b"e" * 4000
                         + b"\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        else:  # what the request carried
            body = json.dumps({"path": path}).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
        return 0

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def hostile(gateway) -> Iterator[HostileUpstream]:
    up = HostileUpstream()
    gateway.world.dns.records[HOST] = "127.0.0.1"
    yield up
    up.close()


@pytest.fixture(scope="module")
def gw(gateway, hostile, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gwframing")
    (tmp / "policies").mkdir()
    policy = {"sandbox": {"name": "framing"}, "network": {"allow_private": ["127.0.0.1/32"], "http": {"allow": [
        {"id": "hostile", "host": HOST, "ports": [hostile.port], "methods": ["GET", "POST"]}]}}}
    (tmp / "policies" / "framing.yaml").write_text(yaml.safe_dump(policy))
    g = start_gateway(gateway.world, tmp)
    yield g
    stop_gateway(g)


def proxy_request(gw, sbx, port: int, method: str, path: str, extra: str = "") -> socket.socket:
    import base64

    sock = socket.create_connection(gw.proxy, timeout=20)
    auth = base64.b64encode(f"{sbx.id}:{sbx.token}".encode()).decode()
    sock.sendall(f"{method} http://{HOST}:{port}{path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
                 f"Proxy-Authorization: Basic {auth}\r\n{extra}\r\n".encode())
    return sock


def outcome(gw, request_id: str) -> dict:
    def find() -> dict | None:
        return next((r for r in gw.audit_records() if r.get("egressgate.request.id") == request_id
                     and r.get("egressgate.operation") == "outcome"), None)
    assert wait_for(lambda: find() is not None, timeout=5), request_id
    return find()  # type: ignore[return-value]


def read_chunked(sock: socket.socket) -> bytes:
    """The de-chunked body of a 200 chunked response (h11 parses it)."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    client.send(h11.EndOfMessage())
    body = b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            assert event.status_code == 200
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return body


def test_endless_upstream_response_head_refused_502(gw, hostile):
    """An upstream sending an endless header line: the gateway closes it after 64 KiB (+ one read),
    answers 502 upstream_response_refused with the flow's request id, audits it on the outcome record.
    Before: the gateway read all 32 MiB (the upstream's sends all succeeded) and the client hung."""
    sbx = gw.admit("framing")
    before = rss(gw.proc.pid)
    s = proxy_request(gw, sbx, hostile.port, "GET", "/endless-head")
    status, headers, body = read_reply(s, timeout=30)
    sent = settled(hostile.seen["/endless-head"])
    assert sent < ENDLESS // 2, f"the gateway accepted {sent} bytes of one response head"
    assert rss(gw.proc.pid) - before < 16 << 20
    assert status == 502, (status, body[:200])
    assert closed_soon(s)
    s.close()
    doc = json.loads(body)
    assert doc["error"] == "upstream_response_refused" and doc["reason"] == "response_header_too_large"
    assert doc["request_id"] == headers["x-egressgate-request-id"]
    rec = outcome(gw, doc["request_id"])
    assert rec.get("egressgate.response_refused") == "response_header_too_large"
    # positive control: a 60 kB head (under the bound) passes whole
    s = proxy_request(gw, sbx, hostile.port, "GET", "/head-under")
    status, headers, body = read_reply(s)
    s.close()
    assert status == 200 and body == b"ok" and headers["x-big"] == "b" * 60000


def test_endless_response_chunk_line_cut(gw, hostile):
    """An upstream whose second chunk-size line never ends: the response already started (the first
    chunk went out), so the client's connection is cut; the upstream is closed after 4 KiB + one read;
    the outcome record says chunk_line_too_large. Positive control: a 4006-byte chunk line passes."""
    sbx = gw.admit("framing")
    before = rss(gw.proc.pid)
    s = proxy_request(gw, sbx, hostile.port, "GET", "/endless-chunk")
    status, headers, _ = read_reply(s, timeout=20)
    assert status == 200
    request_id = headers["x-egressgate-request-id"]
    s.settimeout(20)
    rest = b""
    try:
        while chunk := s.recv(65536):
            rest += chunk
    except OSError:
        pass
    s.close()
    assert b"0\r\n\r\n" not in rest  # never a clean end: the client sees the cut
    sent = settled(hostile.seen["/endless-chunk"])
    assert sent < ENDLESS // 2, f"the gateway accepted {sent} bytes of one chunk-size line"
    assert rss(gw.proc.pid) - before < 16 << 20
    assert outcome(gw, request_id).get("egressgate.response_refused") == "chunk_line_too_large"
    s = proxy_request(gw, sbx, hostile.port, "GET", "/chunk-under")
    assert read_chunked(s) == b"hello world"
    s.close()


def test_endless_request_chunk_line_refused_400(gw, hostile):
    """A sandbox whose request body has an endless chunk-size line: 400 with the deny contract after
    4 KiB (+ one read), closed; the upstream never sees a complete request; the outcome record says
    chunk_line_too_large. Before: the gateway buffered all 32 MiB. Positive control: a 4006-byte chunk
    line (extensions dropped by the gateway) reaches the upstream whole."""
    sbx = gw.admit("framing")
    before = rss(gw.proc.pid)
    s = proxy_request(gw, sbx, hostile.port, "POST", "/upload-endless", "Transfer-Encoding: chunked\r\n")
    sent = send_endless(s, b"5\r\nhello\r\n5;x=")
    status, headers, body = read_reply(s, timeout=20)
    assert sent < ENDLESS // 2, f"the gateway accepted {sent} bytes of one chunk-size line"
    assert rss(gw.proc.pid) - before < 16 << 20
    assert status == 400 and headers.get("x-egressgate-decision") == "deny", (status, body[:200])
    assert closed_soon(s)
    s.close()
    doc = json.loads(body)
    assert doc["error"] == "egress_denied" and doc["reason"] == "invalid_request" and "chunk" in doc["message"]
    assert doc["request_id"] == headers["x-egressgate-request-id"]
    assert not hostile.seen.get("/upload-endless", {}).get("complete")
    assert outcome(gw, doc["request_id"]).get("egressgate.request_refused") == "chunk_line_too_large"
    # the body bytes queued behind the refusal are dropped: they used to crash the connection's layers
    assert "has crashed" not in gw.stderr()
    # positive control
    s = proxy_request(gw, sbx, hostile.port, "POST", "/upload-under", "Transfer-Encoding: chunked\r\n")
    s.sendall(b"5;x=" + b"e" * 4000 + b"\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    status, _, body = read_reply(s)
    s.close()
    assert status == 200 and json.loads(body)["path"] == "/upload-under"
    seen = hostile.seen["/upload-under"]  # "done" is set after the answer is sent: not waited for here
    assert (seen["complete"], seen["body_len"]) == (True, 11), seen
