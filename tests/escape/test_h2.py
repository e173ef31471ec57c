"""HTTP/2 inside an intercepted tunnel: every stream is decided on its own :authority.

One h2 connection can carry many streams; a gateway that checks only the first (or only the CONNECT)
lets stream 3 name another host, which is domain fronting at the stream level. upstream-h2 logs every
stream's :authority. Positive control: a consistent stream on the same connection is answered by the
upstream, and the same streams sent directly (no gateway) are all logged.
"""

from __future__ import annotations

import socket
import ssl
import time

import h2.config
import h2.connection
import h2.events
import pytest

import tests.networld as nw
from tests.escape.checks import SETTLE, assert_untouched, requests_on
from tests.escape.harness import Gateway, Sandbox
from tests.networld import World

pytestmark = pytest.mark.netns

GOOD = "api.allowed.test:9443"
STREAMS = {1: GOOD, 3: "forbidden.test", 5: "169.254.169.254", 7: "api.allowed.test:443", 9: GOOD}


def exchange(tls: ssl.SSLSocket, streams: dict[int, str], timeout: float = 5.0) -> dict[int, int | str]:
    """Send one GET per stream, return {stream: status or 'reset'/'closed'}."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    for sid, authority in streams.items():
        conn.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":authority", authority),
                                (":path", f"/h2-{sid}")], end_stream=True)
    tls.sendall(conn.data_to_send())
    result: dict[int, int | str] = {}
    tls.settimeout(timeout)
    deadline = time.monotonic() + timeout
    while len(result) < len(streams) and time.monotonic() < deadline:
        try:
            data = tls.recv(65536)
        except (TimeoutError, ssl.SSLError, OSError):
            break
        if not data:
            break
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                result[event.stream_id] = int(dict(event.headers)[":status"])
            elif isinstance(event, h2.events.StreamReset):
                result.setdefault(event.stream_id, "reset")
            elif isinstance(event, h2.events.ConnectionTerminated):
                for sid in streams:
                    result.setdefault(sid, "closed")
        out = conn.data_to_send()
        if out:
            tls.sendall(out)
    return result


def test_positive_control_direct_h2_logs_every_authority(world: World) -> None:
    mark = world.mark()

    def run() -> dict[int, int | str]:
        ctx = ssl.create_default_context(cafile=str(world.ca_pem))
        ctx.set_alpn_protocols(["h2"])
        raw = socket.create_connection((nw.UPSTREAM, 9443), timeout=5)
        with ctx.wrap_socket(raw, server_hostname="api.allowed.test") as tls:
            assert tls.selected_alpn_protocol() == "h2"
            return exchange(tls, STREAMS)

    assert set(world.in_ns(world.gw, run).values()) == {200}
    seen = {r["authority"] for r in requests_on(world, mark, "upstream-h2")}
    assert seen == set(STREAMS.values())


def test_each_h2_stream_is_decided_on_its_authority(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, GOOD)
    assert resp.status == 200, resp
    with gateway.tls(sock, "api.allowed.test", alpn=("h2",)) as tls:
        assert tls.selected_alpn_protocol() == "h2", "the gateway should speak h2 when the upstream does"
        result = exchange(tls, STREAMS)
    time.sleep(SETTLE)
    authorities = [r["authority"] or r["host"] for r in requests_on(world, mark, "upstream-h2")]
    assert authorities and set(authorities) <= {GOOD, "api.allowed.test"}, authorities
    assert result.get(1) == 200, result
    for sid in (3, 5, 7):
        assert result.get(sid) in (403, 421, "reset", "closed"), result
    assert world.hits(mark, listener="forbidden-tls") == []
    assert_untouched(world, mark, "h2 streams")
