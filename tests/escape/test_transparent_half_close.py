"""The transparent listener's raw-TCP relay keeps a client's half-close (regression guard).

A client that sends its bytes and then `shutdown(SHUT_WR)` must still read the upstream's answer. The
explicit proxy lost it (mitmproxy's CONNECT stream turned the relay's half-close into a full close;
gateway/tunnels/tunnel_close.py, tests/gateway/test_tcp_half_close.py); the transparent listener runs the relay
directly under its root layer and must keep doing so. Here the gateway holds the client's bytes and FIN
until its decision is recorded, then dials, sends both at once: a relay that closed the upstream on the
client's FIN would drop the world's raw upstream's `RAW-ACK`. Control: the same exchange with the
sending side left open.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.networld import World
from tests.support.http1 import read_all
from tests.support.netgateway import Gateway
from tests.support.transparent import UPSTREAM, Transparent

pytestmark = pytest.mark.netns

NET = "198.18.12"


@pytest.fixture(scope="module")
def thc(world: World, gateway: Gateway) -> Iterator[Transparent]:
    t = Transparent.create(world, gateway, tag="thc", net=NET, table="egC_thalf")
    try:
        yield t
    finally:
        t.close()


@pytest.mark.parametrize("half_close", [True, False])
def test_raw_tcp_reply_after_client_half_close(thc: Transparent, world: World, half_close: bool) -> None:
    mark = world.mark()
    payload = b"\x00\x01 raw request"
    with thc.connect(UPSTREAM, 2222) as sock:
        sock.sendall(payload)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        got = read_all(sock, 2.0, first=10)
    assert got.startswith(b"RAW-ACK %d" % len(payload)), got
    assert [h["event"] for h in world.hits(mark, listener="upstream-raw")][:2] == ["accept", "data"]
