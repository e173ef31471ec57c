"""Domain fronting: CONNECT to an allowed name, then another name in the SNI or the Host header.

``forbidden.test`` (198.18.1.20) is allowed by no escape-https rule; the allowed upstream serves a
certificate for both names, like a CDN would, so fronting *would* work if the gateway forwarded it.
Assertions are on the receiving side: the forbidden host never gets a connection, and the allowed
upstream never gets a request that names another host. Positive controls: the consistent request
succeeds, and under escape-forbidden the gateway does reach forbidden.test (its listener is live).
"""

from __future__ import annotations

import ssl

import pytest

from tests.escape.checks import SETTLE, assert_denied, assert_untouched, requests_on
from tests.networld import World
from tests.support.http1 import read_response
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

FRONT_REASONS = {"host_mismatch", "invalid_request", "host_not_allowed"}


def _forbidden_untouched(world: World, mark) -> None:
    import time

    time.sleep(SETTLE)
    assert world.hits(mark, listener="forbidden-tls") == []
    assert world.hits(mark, listener="forbidden-http") == []
    fronted = [r for r in requests_on(world, mark, "upstream-tls") if r["host"] != "api.allowed.test"
               or (r["sni"] not in (None, "api.allowed.test"))]
    assert fronted == [], f"the allowed upstream received a fronted request: {fronted}"


def _inner(gateway: Gateway, sbx: Sandbox, sni: str | None, host: str):
    sock, resp = gateway.tunnel(sbx, "api.allowed.test:443")
    assert resp.status == 200, resp
    try:
        tls = gateway.tls(sock, sni)
    except (ssl.SSLError, ConnectionError, OSError) as exc:  # refusing the handshake is a valid deny
        sock.close()
        return exc
    with tls:
        tls.sendall(f"GET /fronted HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        try:
            return read_response(tls)
        except (ssl.SSLError, ConnectionError, OSError) as exc:
            return exc


def test_positive_control_consistent_names_reach_upstream(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    resp = _inner(gateway, sbx, "api.allowed.test", "api.allowed.test")
    assert not isinstance(resp, Exception) and resp.status == 200, resp
    [req] = requests_on(world, mark, "upstream-tls")
    assert (req["sni"], req["host"]) == ("api.allowed.test", "api.allowed.test")


@pytest.mark.parametrize(("sni", "host"), [
    ("forbidden.test", "forbidden.test"),
    ("api.allowed.test", "forbidden.test"),
    ("forbidden.test", "api.allowed.test"),
    ("other.allowed.test", "other.allowed.test"),   # another *allowed* name is still another name
    ("api.allowed.test", "api.allowed.test:8443"),  # same name, other port
    ("api.allowed.test", "API.ALLOWED.TEST.evil.test"),
    ("2852039166", "api.allowed.test"),             # an encoded IP as SNI (Python sends no SNI for IPs)
    ("2852039166", "169.254.169.254"),
])
def test_fronting_inside_connect_is_refused(
    world: World, gateway: Gateway, sbx: Sandbox, sni: str, host: str
) -> None:
    mark = world.mark()
    resp = _inner(gateway, sbx, sni, host)
    if not isinstance(resp, Exception):
        assert_denied(resp, FRONT_REASONS, statuses=(400, 403, 421))
    _forbidden_untouched(world, mark)


def test_connect_to_forbidden_name_with_allowed_sni_is_denied(
    world: World, gateway: Gateway, sbx: Sandbox
) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "forbidden.test:443")
    with sock:
        assert_denied(resp, {"host_not_allowed"})
    _forbidden_untouched(world, mark)


def test_connect_to_upstream_ip_with_allowed_sni_is_denied(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    """The allowed name's IP is not the allowed name: no rule names 198.18.1.10."""
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "198.18.1.10:443")
    with sock:
        assert_denied(resp, {"host_not_allowed"})
    time_ok = requests_on(world, mark, "upstream-tls")
    assert time_ok == []


def test_client_hello_without_sni_gets_the_connect_name(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    resp = _inner(gateway, sbx, None, "api.allowed.test")
    assert not isinstance(resp, Exception) and resp.status == 200, resp
    [req] = requests_on(world, mark, "upstream-tls")
    assert req["sni"] == "api.allowed.test"


def test_positive_control_forbidden_host_is_live_when_allowed(world: World, gateway: Gateway) -> None:
    sbx_f = gateway.admit("escape-forbidden")
    mark = world.mark()
    res = gateway.curl(sbx_f, "https://forbidden.test/control")
    assert res.status == 200, res
    assert any(h["event"] == "request" for h in world.hits(mark, listener="forbidden-tls"))


@pytest.mark.parametrize("port", [443, 80])
def test_absolute_form_inside_tunnel_cannot_redirect_it(
    world: World, gateway: Gateway, sbx: Sandbox, port: int
) -> None:
    """A proxy-style request *inside* a tunnel (TLS on 443, plaintext on 80) naming another host."""
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, f"api.allowed.test:{port}")
    if resp.status != 200:  # refusing a plaintext tunnel to the http port is also fine
        sock.close()
        assert_denied(resp)
        return
    conn = gateway.tls(sock, "api.allowed.test") if port == 443 else sock
    with conn:
        for url in ("http://169.254.169.254/latest/meta-data/", "http://forbidden.test/x"):
            conn.sendall(f"GET {url} HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n".encode())
            try:
                inner = read_response(conn)
            except (ConnectionError, OSError, ssl.SSLError):
                break
            assert_denied(inner, FRONT_REASONS, statuses=(400, 403, 421))
            if inner.headers.get("connection", "").lower() == "close":
                break
    assert_untouched(world, mark, "absolute-form in tunnel")
    _forbidden_untouched(world, mark)
