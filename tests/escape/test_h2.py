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

import pytest

import tests.networld as nw
from tests.escape.checks import SETTLE, assert_untouched, requests_on
from tests.escape.h2streams import GOOD, STREAMS, exchange
from tests.networld import World
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

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
