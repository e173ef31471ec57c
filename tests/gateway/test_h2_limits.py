"""HTTP/2 header blocks are bounded (gateway/layers/h2_limits.py; the CONTINUATION-flood class, CVE-2024-27316).

h2 buffered a header block split over CONTINUATION frames up to 64 frames of the 128 KiB mitmproxy
allows: ~8 MiB per connection before decoding anything. Through a real CONNECT tunnel with TLS and h2,
a raw client sends a HEADERS frame without END_HEADERS and then CONTINUATION frames of 128 KiB: the
gateway must answer GOAWAY (and close) after the first one pushed the block over 64 KiB, not after
the 64th. Positive control: a real request whose 40 kB header block is split over CONTINUATION frames
gets the upstream's 200.
"""

from __future__ import annotations

import json
import ssl

import h2.config
import h2.connection
import h2.events
from hyperframe.frame import ContinuationFrame, HeadersFrame

from tests.support.gwworld import connect_tunnel
from tests.support.waiting import wait_for

FRAME = 128 * 1024 - 1  # under mitmproxy's advertised max frame size (2**17)


def h2_tunnel(gateway, sbx) -> tuple[ssl.SSLSocket, str]:
    authority = f"h2.test:{gateway.world.h2_port}"
    sock, head = connect_tunnel(gateway, sbx, authority)
    assert head.startswith(b"HTTP/1.1 200"), head
    ctx = ssl.create_default_context(cafile=gateway.bundle)
    ctx.set_alpn_protocols(["h2"])
    tls = ctx.wrap_socket(sock, server_hostname="h2.test")
    assert tls.selected_alpn_protocol() == "h2"
    tls.settimeout(5)
    return tls, authority


def events_until(tls: ssl.SSLSocket, conn: h2.connection.H2Connection, want: tuple, timeout: float = 5,
                 reply: bool = True) -> list:
    """h2 events from the gateway until one of type `want`, EOF or a reset (then a ConnectionTerminated
    stand-in: the string 'closed'). `reply=False`: send nothing back (no SETTINGS ACK in the middle of
    an open header block, which would itself be a protocol error)."""
    tls.settimeout(timeout)
    seen: list = []
    while True:
        try:
            data = tls.recv(65536)
        except TimeoutError:
            return seen
        except OSError:
            return [*seen, "closed"]
        if not data:
            return [*seen, "closed"]
        for event in conn.receive_data(data):
            seen.append(event)
            if isinstance(event, want):
                return seen
        out = conn.data_to_send()
        if out and reply:
            tls.sendall(out)


def test_continuation_flood_refused_after_64_kib(gateway):
    sbx = gateway.admit("gw-basic")
    tls, authority = h2_tunnel(gateway, sbx)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    tls.sendall(conn.data_to_send())  # preface + SETTINGS; the raw frames below bypass the state machine
    block = conn.encoder.encode([(":method", "GET"), (":scheme", "https"), (":authority", authority),
                                 (":path", "/ok/flood")])
    headers = HeadersFrame(1, data=block)  # no END_HEADERS: a header block that never ends
    headers.flags.add("END_STREAM")
    tls.sendall(headers.serialize())
    sent = 0
    try:
        for _ in range(40):  # 5 MiB: under h2's own 64-frame backlog, so only a byte bound stops it
            tls.sendall(ContinuationFrame(1, data=b"\x00" * FRAME).serialize())
            sent += FRAME
            if sent > 2 * FRAME:
                break  # the bound must have fired by now; what follows is read below
    except OSError:
        pass
    seen = events_until(tls, conn, (h2.events.ConnectionTerminated,), reply=False)
    tls.close()
    assert seen and (isinstance(seen[-1], h2.events.ConnectionTerminated) or seen[-1] == "closed"), seen
    # positive control: a 40 kB header block, split by h2 over CONTINUATION frames (16 KiB frames until the
    # gateway's SETTINGS are read), is served
    tls, authority = h2_tunnel(gateway, sbx)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    pad = [(f"x-pad-{i}", "".join(chr(33 + (i * 7 + j) % 90) for j in range(4000))) for i in range(10)]
    conn.send_headers(1, [(":method", "GET"), (":scheme", "https"), (":authority", authority),
                          (":path", "/ok/big-headers"), *pad], end_stream=True)
    tls.sendall(conn.data_to_send())
    seen = events_until(tls, conn, (h2.events.StreamEnded, h2.events.ConnectionTerminated), timeout=10)
    status = next((dict(e.headers).get(b":status") for e in seen if isinstance(e, h2.events.ResponseReceived)), None)
    body = b"".join(e.data for e in seen if isinstance(e, h2.events.DataReceived))
    tls.close()
    assert status == b"200", seen
    assert json.loads(body)["path"] == "/ok/big-headers"


def test_upstream_continuation_flood_refused(gateway):
    """The upstream side: a hostile HTTP/2 upstream answering with a header block that never ends. Every
    HTTP/2 server speaks first (SETTINGS), and mitmproxy then built a stock Http2Client for it, so the
    gateway's bound (GatewayHttp2Client) never applied upstream: h2 took 64 frames before refusing. Now
    the gateway gives up after 64 KiB (+ one frame) and the sandbox gets a refusal, not a hang. Positive
    control: the same tunnel kind serves a normal request."""
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    tls, authority = h2_tunnel(gateway, sbx)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "GET"), (":scheme", "https"), (":authority", authority),
                          (":path", "/ok/upstream-continuation-flood")], end_stream=True)
    tls.sendall(conn.data_to_send())
    seen = events_until(tls, conn, (h2.events.StreamEnded, h2.events.StreamReset,
                                    h2.events.ConnectionTerminated), timeout=30)
    tls.close()
    status = next((dict(e.headers).get(b":status") for e in seen if isinstance(e, h2.events.ResponseReceived)), None)
    assert status != b"200", seen  # the upstream's never-ending 200 never reaches the sandbox
    refused = status is not None or (seen and (seen[-1] == "closed" or isinstance(
        seen[-1], (h2.events.StreamReset, h2.events.ConnectionTerminated))))
    assert refused, f"the sandbox got no answer: {seen}"
    # the hostile upstream records what it managed to send once the gateway closes on it, which may come
    # just after the sandbox saw the refusal: wait for that record instead of reading it at once
    def flood_result() -> dict | None:
        return next((h for h in gateway.world.hits.since(mark) if h.get("path") == "upstream-flood-result"), None)

    assert wait_for(lambda: flood_result() is not None, timeout=10), "the hostile upstream recorded nothing"
    result = flood_result()
    assert not result.get("ignored"), result
    assert result["bytes"] <= 64 * 1024 + 2 * 16000, f"the gateway took {result['bytes']} bytes of one header block"
    # positive control: an ordinary request over the same kind of tunnel is served
    tls, authority = h2_tunnel(gateway, sbx)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "GET"), (":scheme", "https"), (":authority", authority),
                          (":path", "/ok/after-flood")], end_stream=True)
    tls.sendall(conn.data_to_send())
    seen = events_until(tls, conn, (h2.events.StreamEnded, h2.events.ConnectionTerminated), timeout=10)
    tls.close()
    status = next((dict(e.headers).get(b":status") for e in seen if isinstance(e, h2.events.ResponseReceived)), None)
    assert status == b"200", seen
