"""A refusal reaches the client as the deny contract whatever the body's size or framing (issue 21 item 2,
issue 23 item 6).

Before: a denied request with a body over ~64 KiB (or chunked) was decided and audited, then killed so as
not to buffer it; curl printed mitmproxy's HTML 400 ("peer closed connection without sending complete
message body" / "incomplete chunked read"), requests hung or raised SSLEOFError. Now the answer goes out
before the body is read (no `100 Continue`), then the connection lingers (HTTP/1) or the stream drains
(HTTP/2) so that every client reads it (gateway/layers/early_answer.py).

Each case runs a real client (the curl binary, requests, httpx over HTTP/1.1 and HTTP/2) through the
explicit proxy (intercepted CONNECT, and plain HTTP) against a counting upstream
(tests/support/uploadworld.py): the client gets the JSON with its reason; the upstream never sees the
request head. Positive controls: the same uploads to the allowed path arrive whole. The transparent
listener's cases are in tests/escape/test_transparent_big_deny.py.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gwworld import World, auth, connect_tunnel, tls_wrap
from tests.support.http1 import read_reply
from tests.support.uploadworld import UploadWorld, curl, open_upload_world, python_client
from tests.support.waiting import wait_for

KB, MB = 1024, 1024 * 1024
SIZES = [KB, 64 * KB, MB, 20 * MB]
SIZE_IDS = ["1KB", "64KB", "1MB", "20MB"]


@pytest.fixture(scope="module")
def uw(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UploadWorld]:
    with open_upload_world(world, tmp_path_factory.mktemp("bigdeny")) as u:
        yield u


@pytest.fixture(autouse=True)
def gateway_logged_no_error(request: pytest.FixtureRequest) -> Iterator[None]:
    """A refusal path that crashes a connection's layers (mitmproxy logs "has crashed!" and carries on)
    fails the test that caused it, whatever the client saw."""
    if "uw" not in request.fixturenames:
        yield
        return
    gw = request.getfixturevalue("uw").gw
    before = len(gw.stderr())
    yield
    new = gw.stderr()[before:]
    errors = [line[:300] for line in new.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not errors, "the gateway logged errors:\n" + "\n".join(errors)


def heads_seen(uw: UploadWorld, mark: int) -> list[dict]:
    """What reached the upstream beyond a TCP connection without a request (the gateway dials an allowed
    CONNECT's host eagerly; a denied request must never get further than that)."""
    return [e for e in uw.seen.since(mark) if e["event"] not in ("accept", "eof", "error") or e.get("path")]


def assert_refused(uw: UploadWorld, mark: int, up, reason: str = "path_not_allowed", status: int = 403) -> dict:
    assert up.status == status, str(up)
    doc = up.deny()
    assert doc["reason"] == reason, doc
    assert heads_seen(uw, mark) == [], uw.seen.since(mark)
    return doc


def assert_arrived(uw: UploadWorld, mark: int, up, size: int) -> None:
    assert up.status == 200, str(up)
    done = [e for e in uw.seen.since(mark) if e["event"] == "done"]
    assert [(e["path"], e["body_len"]) for e in done] == [("/allowed", size)], uw.seen.since(mark)


# ------------------------------------------------------------------------------ curl, HTTP/1.1
@pytest.mark.parametrize("expect", [None, False, True], ids=["expect-default", "no-expect", "expect"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_curl_https_denied_upload_gets_the_json(uw: UploadWorld, size: int, chunked: bool, expect) -> None:
    sbx = uw.admit()
    mark = uw.seen.mark()
    up = curl(uw, sbx, uw.url("/denied"), size, chunked=chunked, expect=expect)
    assert_refused(uw, mark, up)
    assert "rc=0" in up.error, str(up)  # curl itself reports success: it read a whole response


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size", [MB, 20 * MB], ids=["1MB", "20MB"])
def test_curl_https_allowed_upload_arrives(uw: UploadWorld, size: int, chunked: bool) -> None:
    """Positive control: the same upload to the allowed path reaches the upstream whole."""
    sbx = uw.admit()
    mark = uw.seen.mark()
    assert_arrived(uw, mark, curl(uw, sbx, uw.url("/allowed"), size, chunked=chunked), size)


@pytest.mark.parametrize("expect", [None, False], ids=["expect-default", "no-expect"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size", [64 * KB, 20 * MB], ids=["64KB", "20MB"])
def test_curl_plain_http_denied_upload_gets_the_json(uw: UploadWorld, size: int, chunked: bool, expect) -> None:
    sbx = uw.admit()
    mark = uw.seen.mark()
    up = curl(uw, sbx, uw.url("/denied", "plain"), size, chunked=chunked, expect=expect)
    assert_refused(uw, mark, up)
    assert uw.seen.since(mark) == []  # plain HTTP dials only for an allowed request: not even a connection
    mark = uw.seen.mark()
    control = curl(uw, sbx, uw.url("/allowed", "plain"), size, chunked=chunked, expect=expect)
    assert_arrived(uw, mark, control, size)


# ------------------------------------------------------------------------------ curl, HTTP/2
@pytest.mark.parametrize("expect", [None, True], ids=["expect-default", "expect"])
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_curl_http2_denied_upload_gets_the_json(uw: UploadWorld, size: int, expect) -> None:
    sbx = uw.admit()
    mark = uw.seen.mark()
    up = curl(uw, sbx, uw.url("/denied", "h2"), size, expect=expect, http2=True)
    assert_refused(uw, mark, up)
    assert "rc=0" in up.error, str(up)


def test_curl_http2_allowed_upload_arrives(uw: UploadWorld) -> None:
    sbx = uw.admit()
    mark = uw.seen.mark()
    assert_arrived(uw, mark, curl(uw, sbx, uw.url("/allowed", "h2"), 20 * MB, http2=True), 20 * MB)


# ------------------------------------------------------------------------------ requests and httpx
@pytest.mark.parametrize("client", ["requests", "httpx", "httpx2"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_python_clients_denied_upload_get_the_json(uw: UploadWorld, size: int, chunked: bool, client: str) -> None:
    sbx = uw.admit()
    mark = uw.seen.mark()
    kind = "h2" if client == "httpx2" else "tls"
    up = python_client(uw, sbx, uw.url("/denied", kind), size, client=client, chunked=chunked)
    assert_refused(uw, mark, up)


@pytest.mark.parametrize("client", ["requests", "httpx"])
def test_python_clients_with_expect_header_get_the_json(uw: UploadWorld, client: str) -> None:
    """These clients send the body at once even with `Expect: 100-continue` (they do not wait for 100):
    the answer still arrives, never a `100 Continue` first."""
    sbx = uw.admit()
    mark = uw.seen.mark()
    up = python_client(uw, sbx, uw.url("/denied"), 20 * MB, client=client, expect=True)
    assert_refused(uw, mark, up)


@pytest.mark.parametrize("client", ["requests", "httpx"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_python_clients_plain_http_denied_and_allowed(uw: UploadWorld, client: str, chunked: bool) -> None:
    sbx = uw.admit()
    mark = uw.seen.mark()
    up = python_client(uw, sbx, uw.url("/denied", "plain"), 20 * MB, client=client, chunked=chunked)
    assert_refused(uw, mark, up)
    mark = uw.seen.mark()
    control = python_client(uw, sbx, uw.url("/allowed", "plain"), 20 * MB, client=client, chunked=chunked)
    assert_arrived(uw, mark, control, 20 * MB)


@pytest.mark.parametrize("client", ["requests", "httpx", "httpx2"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_python_clients_allowed_upload_arrives(uw: UploadWorld, client: str, chunked: bool) -> None:
    sbx = uw.admit()
    mark = uw.seen.mark()
    kind = "h2" if client == "httpx2" else "tls"
    up = python_client(uw, sbx, uw.url("/allowed", kind), 20 * MB, client=client, chunked=chunked)
    assert_arrived(uw, mark, up, 20 * MB)


# ------------------------------------------------------------------------------ other refusals at the headers
def test_unknown_identity_with_a_large_body_gets_407_json(uw: UploadWorld) -> None:
    """The identity refusal is answered before the body too (a wrong token; control: the right one)."""
    sbx = uw.admit()
    wrong = type(sbx)(id=sbx.id, token=sbx.token + "x", proxy_url="", env={}, gw=sbx.gw)
    mark = uw.seen.mark()
    up = curl(uw, wrong, uw.url("/allowed", "plain"), 20 * MB, chunked=True, expect=False)
    assert_refused(uw, mark, up, reason="identity_unknown", status=407)
    up = python_client(uw, wrong, uw.url("/allowed", "plain"), 20 * MB, client="requests")
    assert_refused(uw, mark, up, reason="identity_unknown", status=407)
    assert_arrived(uw, mark, curl(uw, sbx, uw.url("/allowed", "plain"), 20 * MB, chunked=True), 20 * MB)


def test_chunked_upload_refused_for_a_spent_budget_gets_429_json(uw: UploadWorld) -> None:
    """Issue 23 item 6: the budget is spent (to the byte, by a first upload that arrived: the positive
    control), so a chunked upload is refused at its headers — and the client reads the 429 JSON, not
    mitmproxy's HTML 400 "incomplete chunked read"."""
    sbx = uw.admit("gw-bigdeny-budget")
    head = f"POST /allowed HTTP/1.1\r\nHost: bigdeny.test:{uw.tls_port}\r\nContent-Length: {{n}}\r\n\r\n"
    n = 3000 - len(head.format(n=0))
    for _ in range(5):  # the length's own digits count
        n = 3000 - len(head.format(n=n))
    raw = head.format(n=n).encode() + b"b" * n
    assert len(raw) == 3000
    mark = uw.seen.mark()
    sock, answer = connect_tunnel(uw.gw, sbx, f"bigdeny.test:{uw.tls_port}")
    assert answer.startswith(b"HTTP/1.1 200"), answer
    with tls_wrap(sock, uw.gw, "bigdeny.test") as tls:
        tls.sendall(raw)
        status, _, _ = read_reply(tls)
    assert status == 200
    assert [e["body_len"] for e in uw.seen.since(mark) if e["event"] == "done"] == [n]
    for client in ("curl", "requests"):
        mark = uw.seen.mark()
        if client == "curl":
            up = curl(uw, sbx, uw.url("/allowed", "plain"), MB, chunked=True)
        else:
            up = python_client(uw, sbx, uw.url("/allowed", "plain"), MB, client="requests", chunked=True)
        doc = assert_refused(uw, mark, up, reason="budget_exceeded", status=429)
        assert "budget" in doc["message"]


# ------------------------------------------------------------------------------ raw framing
def test_raw_client_sees_the_answer_before_sending_its_body(uw: UploadWorld) -> None:
    """`Expect: 100-continue` is answered with the deny, not `100 Continue`: a client that waits for it
    reads the refusal having sent no body at all; the connection then closes (lingering close: FIN)."""
    sbx = uw.admit()
    mark = uw.seen.mark()
    sock = socket.create_connection(uw.gw.proxy, timeout=10)
    with sock:
        sock.sendall(
            f"POST http://bigdeny.test:{uw.plain_port}/denied HTTP/1.1\r\nHost: bigdeny.test:"
            f"{uw.plain_port}\r\n{auth(sbx)}Content-Length: {100 * MB}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        status, headers, body = read_reply(sock)
        assert status == 403 and headers.get("x-egressgate-decision") == "deny", (status, headers, body)
        assert b"path_not_allowed" in body
        sock.settimeout(15)
        assert sock.recv(1) == b""  # FIN after the answer, nothing else
    assert uw.seen.since(mark) == []


def test_audit_names_the_refusal_the_client_read(uw: UploadWorld) -> None:
    sbx = uw.admit()
    up = curl(uw, sbx, uw.url("/denied"), 20 * MB, expect=False)
    rid = up.deny()["request_id"]

    def records() -> list[dict]:
        return [r for r in uw.gw.audit_records() if r.get("egressgate.request.id") == rid]

    assert wait_for(records, timeout=10), f"no audit record for {rid}"
    first = records()[0]
    assert (first["egressgate.decision"], first["egressgate.reason"]) == ("deny", "path_not_allowed"), first


# ------------------------------------------------------------------------------ memory
def _peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_denied_uploads_are_never_buffered(world: World, tmp_path: Path) -> None:
    """A fresh gateway's peak RSS barely moves while it refuses five 20 MiB uploads sent without waiting
    (no `Expect`), chunked and with Content-Length, HTTP/1.1 and HTTP/2: it answers and discards, it
    never holds a body. (Before, mitmproxy would buffer a denied body whole to answer it; the gateway
    killed those flows instead, so no client read its refusal.)"""
    with open_upload_world(world, tmp_path) as fresh:
        sbx = fresh.admit()
        curl(fresh, sbx, fresh.url("/denied"), KB)  # warm up: TLS contexts, the leaf certificate, imports
        python_client(fresh, sbx, fresh.url("/denied", "h2"), KB, client="httpx2")
        before = _peak_kib(fresh.gateway_pid())
        mark = fresh.seen.mark()
        ups = [
            curl(fresh, sbx, fresh.url("/denied"), 20 * MB, expect=False),
            curl(fresh, sbx, fresh.url("/denied"), 20 * MB, expect=False, chunked=True),
            python_client(fresh, sbx, fresh.url("/denied"), 20 * MB, client="requests"),
            python_client(fresh, sbx, fresh.url("/denied"), 20 * MB, client="requests", chunked=True),
            python_client(fresh, sbx, fresh.url("/denied", "h2"), 20 * MB, client="httpx2"),
        ]
        grew = _peak_kib(fresh.gateway_pid()) - before
        print(f"gateway peak RSS before {before} KiB, growth while refusing 5 x 20 MiB: {grew} KiB")
        for up in ups:
            assert_refused(fresh, mark, up)
        assert grew < 10 * 1024, f"peak RSS grew by {grew} KiB while refusing 20 MiB uploads"


def test_http2_drain_is_bounded_and_the_connection_goes_on(uw: UploadWorld) -> None:
    """HTTP/2: after the answer the stream's DATA is discarded up to LINGER_MAX_BYTES, then the stream is
    reset with NO_ERROR (RFC 9113 8.1); the connection's other streams are untouched: an allowed upload on
    the same connection arrives (positive control)."""
    import select
    import ssl

    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions

    from egressgate.gateway.layers.http1_framing import LINGER_MAX_BYTES, LINGER_SECONDS

    sbx = uw.admit()
    mark = uw.seen.mark()
    raw, answer = connect_tunnel(uw.gw, sbx, f"bigdeny.test:{uw.h2_port}")
    assert answer.startswith(b"HTTP/1.1 200"), answer
    ctx = ssl.create_default_context(cafile=uw.gw.bundle)
    ctx.set_alpn_protocols(["h2"])
    with ctx.wrap_socket(raw, server_hostname="bigdeny.test") as tls:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        tls.sendall(conn.data_to_send())

        def headers(path: str) -> list[tuple[str, str]]:
            return [
                (":method", "POST"),
                (":scheme", "https"),
                (":authority", f"bigdeny.test:{uw.h2_port}"),
                (":path", path),
            ]

        events: list = []

        def pump(until) -> None:
            tls.settimeout(30)
            while not until():
                data = tls.recv(65536)
                assert data, f"connection closed; events so far: {events}"
                events.extend(conn.receive_data(data))
                tls.sendall(conn.data_to_send())

        conn.send_headers(1, headers("/denied"))
        tls.sendall(conn.data_to_send())
        pump(lambda: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == 1 for e in events))
        answered = time.monotonic()
        status = next(dict(e.headers)[b":status"] for e in events if isinstance(e, h2.events.ResponseReceived))
        assert status == b"403"
        sent, reset = 0, None
        piece = b"u" * 16384
        while reset is None and sent < LINGER_MAX_BYTES + 16 * 1024 * 1024:
            window = min(conn.local_flow_control_window(1), conn.max_outbound_frame_size)
            if window < len(piece):
                pump(
                    lambda: (
                        conn.local_flow_control_window(1) >= len(piece)
                        or any(isinstance(e, h2.events.StreamReset) for e in events)
                    )
                )
            else:
                try:
                    conn.send_data(1, piece)
                except h2.exceptions.StreamClosedError:
                    break
                sent += len(piece)
                tls.sendall(conn.data_to_send())
            readable, _, _ = select.select([tls], [], [], 0)
            if readable or tls.pending():
                data = tls.recv(65536)
                assert data, f"connection closed; events so far: {events}"
                events.extend(conn.receive_data(data))
                tls.sendall(conn.data_to_send())
            reset = next((e for e in events if isinstance(e, h2.events.StreamReset) and e.stream_id == 1), None)
        if reset is None:
            pump(lambda: any(isinstance(e, h2.events.StreamReset) and e.stream_id == 1 for e in events))
            reset = next(e for e in events if isinstance(e, h2.events.StreamReset) and e.stream_id == 1)
        assert reset.error_code == 0, reset  # NO_ERROR
        # not before a bound: the bytes, or (on a slow machine) the time
        assert sent >= LINGER_MAX_BYTES or time.monotonic() - answered >= LINGER_SECONDS, sent
        # the same connection still carries an allowed upload
        conn.send_headers(3, headers("/allowed"))
        conn.send_data(3, b"v" * 1000, end_stream=True)
        tls.sendall(conn.data_to_send())
        pump(lambda: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == 3 for e in events))
    assert [e for e in heads_seen(uw, mark) if e["event"] == "done"] == [
        {"event": "done", "listener": "h2", "path": "/allowed", "body_len": 1000}
    ]
    assert not [e for e in heads_seen(uw, mark) if e.get("path") == "/denied"]
