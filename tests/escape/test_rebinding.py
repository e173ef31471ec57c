"""DNS rebinding: a resolver that answers 198.18.1.10 then 169.254.169.254 (or 127.0.0.1), TTL 0.

The gateway must check the address it dials, not an earlier answer: whatever mix of allowed and denied
requests the alternation produces, the canary never sees a connection. Positive controls: the resolver
log proves the forbidden answer was delivered to the gateway, and the first (benign) answer really
reaches the upstream, so the name is usable and the test is not vacuous.
"""

from __future__ import annotations

import pytest

import tests.networld as nw
from tests.escape.checks import ADDRESS_REASONS, assert_denied, assert_untouched, requests_on
from tests.networld import World
from tests.support.http1 import read_response
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

REBIND = {"rebind.evil.test": "169.254.169.254", "rebind-lo.evil.test": "127.0.0.1"}
ROUNDS = 6


@pytest.fixture
def fresh_dns(world: World):
    """Restore the default answers after a test that rewrote them."""
    yield
    world.set_dns(nw.DEFAULT_DNS)


def _bad_answers(world: World, mark, name: str, bad: str) -> int:
    return sum(bad in q["answers"] for q in world.dns_queries(mark) if q["qname"] == name)


@pytest.mark.parametrize("name", sorted(REBIND))
@pytest.mark.parametrize("scheme", ["http", "https"])
def test_alternating_answers_never_reach_the_canary(
    world: World, gateway: Gateway, sbx: Sandbox, name: str, scheme: str
) -> None:
    mark = world.mark()
    statuses = []
    for i in range(ROUNDS):
        res = gateway.curl(sbx, f"{scheme}://{name}/round-{i}")
        statuses.append(res.connect_status if res.connect_status not in (0, 200) else res.status)
        if res.status != 200:
            assert_denied(res, ADDRESS_REASONS)
    assert_untouched(world, mark, name)
    assert _bad_answers(world, mark, name, REBIND[name]) >= 1, "the rebinding answer was never delivered"
    assert 200 in statuses, f"positive control: the benign answer should have been usable: {statuses}"
    listener = "upstream-tls" if scheme == "https" else "upstream-http"
    assert requests_on(world, mark, listener), "the benign answer should have reached the upstream"


def test_flip_after_first_request_is_denied(world: World, gateway: Gateway, sbx: Sandbox, fresh_dns) -> None:
    """Deterministic variant: allowed first, then the name flips to the metadata address."""
    records = dict(nw.DEFAULT_DNS)
    records["flip.evil.test"] = {"A": [nw.UPSTREAM]}
    world.set_dns(records)
    mark = world.mark()
    first = gateway.curl(sbx, "http://flip.evil.test/before")
    assert first.status == 200, first
    records["flip.evil.test"] = {"A": ["169.254.169.254"]}
    world.set_dns(records)
    for i in range(3):
        res = gateway.curl(sbx, f"http://flip.evil.test/after-{i}")
        assert_denied(res, ADDRESS_REASONS)
    assert_untouched(world, mark, "flip.evil.test")


def test_keepalive_tunnel_stays_pinned_while_dns_flips(
    world: World, gateway: Gateway, sbx: Sandbox, fresh_dns
) -> None:
    """Several requests on one intercepted tunnel while the name's answer flips underneath it."""
    records = dict(nw.DEFAULT_DNS)
    records["pin.evil.test"] = {"A": [nw.UPSTREAM]}
    world.set_dns(records)
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "pin.evil.test:443")
    assert resp.status == 200, resp
    records["pin.evil.test"] = {"A": ["169.254.169.254"]}
    world.set_dns(records)
    with gateway.tls(sock, "pin.evil.test") as tls:
        for i in range(3):
            tls.sendall(f"GET /pinned-{i} HTTP/1.1\r\nHost: pin.evil.test\r\n\r\n".encode())
            inner = read_response(tls)
            assert inner.status in (200, 403), inner
    assert_untouched(world, mark, "pin.evil.test")


def test_keepalive_plain_connection_flip_is_decided_per_request(
    world: World, gateway: Gateway, sbx: Sandbox, fresh_dns
) -> None:
    """Plain-proxy keep-alive: request 1 resolves to the upstream, then the name flips; request 2 on
    the same client connection must be re-checked (or stay pinned), never dialled at the canary."""
    records = dict(nw.DEFAULT_DNS)
    records["ka.evil.test"] = {"A": [nw.UPSTREAM]}
    world.set_dns(records)
    mark = world.mark()
    req = (f"GET http://ka.evil.test/{{n}} HTTP/1.1\r\nHost: ka.evil.test\r\n"
           f"Proxy-Authorization: {sbx.auth_header}\r\n\r\n")
    with gateway.connect() as sock:
        sock.sendall(req.format(n="first").encode())
        assert read_response(sock).status == 200
        records["ka.evil.test"] = {"A": ["169.254.169.254"]}
        world.set_dns(records)
        sock.sendall(req.format(n="second").encode())
        second = read_response(sock)
    if second.status != 200:
        assert_denied(second, ADDRESS_REASONS)
    assert_untouched(world, mark, "ka.evil.test")
    assert [r["target"] for r in requests_on(world, mark, "upstream-http")][:1] == ["/first"]
