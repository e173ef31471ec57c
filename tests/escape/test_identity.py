"""Using the gateway without (or with someone else's) identity, and leaking identity upstream.

Unknown identity gets 407 and nothing is forwarded; a keep-alive plain-proxy connection does not lend
the first request's identity to the next one; a token for a real sandbox id that is wrong is refused;
Proxy-Authorization never reaches an upstream, also when sent inside a tunnel. Positive control: the
same requests with the right identity are forwarded.
"""

from __future__ import annotations

import time

import pytest

from tests.escape.checks import SETTLE, assert_denied, requests_on
from tests.networld import World
from tests.support.http1 import parse_response, read_response
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

GET = "GET http://api.allowed.test/id HTTP/1.1\r\nHost: api.allowed.test\r\n{auth}\r\n"


def _forwarded(world: World, mark) -> list[dict]:
    time.sleep(SETTLE)
    return requests_on(world, mark, "upstream-http") + requests_on(world, mark, "upstream-tls")


@pytest.mark.parametrize("auth", ["", "Proxy-Authorization: Basic Zm9vOmJhcg==\r\n",
                                  "Proxy-Authorization: Bearer x\r\n", "Proxy-Authorization: Basic !!!\r\n"])
def test_unknown_identity_gets_407_and_nothing_is_forwarded(world: World, gateway: Gateway, auth: str) -> None:
    mark = world.mark()
    resp = parse_response(gateway.raw(GET.format(auth=auth).encode()))
    assert_denied(resp, {"identity_unknown"}, statuses=(407,))
    assert _forwarded(world, mark) == []


def test_wrong_token_for_real_sandbox_is_refused(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    forged = Sandbox(id=sbx.id, token=sbx.token[:-2] + ("AA" if not sbx.token.endswith("AA") else "BB"),
                     proxy_url="", policy=sbx.policy)
    mark = world.mark()
    resp = parse_response(gateway.raw(GET.format(auth=f"Proxy-Authorization: {forged.auth_header}\r\n").encode()))
    assert_denied(resp, {"identity_unknown"}, statuses=(407,))
    sock, cresp = gateway.tunnel(forged, "api.allowed.test:443")
    with sock:
        assert_denied(cresp, {"identity_unknown"}, statuses=(407,))
    assert _forwarded(world, mark) == []


def test_keepalive_plain_connection_does_not_lend_identity(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    with gateway.connect() as sock:
        sock.sendall(GET.format(auth=f"Proxy-Authorization: {sbx.auth_header}\r\n").encode())
        first = read_response(sock)
        assert first.status == 200, first  # positive control: with identity it is forwarded
        sock.sendall(GET.format(auth="").encode())
        second = read_response(sock)
    assert_denied(second, {"identity_unknown"}, statuses=(407,))
    assert len(_forwarded(world, mark)) == 1


def test_proxy_authorization_inside_tunnel_is_not_forwarded(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "api.allowed.test:443")
    assert resp.status == 200, resp
    with gateway.tls(sock, "api.allowed.test") as tls:
        tls.sendall(f"GET /inner HTTP/1.1\r\nHost: api.allowed.test\r\nProxy-Authorization: {sbx.auth_header}\r\n"
                    f"Connection: close\r\n\r\n".encode())
        inner = read_response(tls)
    assert inner.status == 200, inner
    [req] = requests_on(world, mark, "upstream-tls")
    assert not any(n.lower() in ("proxy-authorization", "proxy-connection") for n, _ in req["headers"]), req
    assert sbx.token not in str(req)
