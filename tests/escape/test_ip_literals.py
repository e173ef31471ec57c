"""Forbidden IP literals, in every spelling, in every place a destination can be named.

The escape-https policy *allows* 169.254.169.254, 10.0.0.5 and 127.0.0.1 by rule, so nothing but the
gateway's canonicalisation and address classification stands between these requests and the canaries.
Positive controls: every spelling, given to curl directly in the gateway namespace, lands on its canary
(the encoding is live); and under escape-private (allow_private covers 10.0.0.5) the gateway itself
dials the private canary for the encoded forms (canonicalisation works end to end).
"""

from __future__ import annotations

import pytest

import tests.networld as nw
from tests.escape.checks import ADDRESS_REASONS, assert_denied, assert_untouched, proxied_get
from tests.networld import World
from tests.support.http1 import parse_response, read_response
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

# spelling -> canary it reaches when dialled
METADATA_FORMS = {
    "169.254.169.254": "metadata",
    "2852039166": "metadata",
    "0251.0376.0251.0376": "metadata",
    "0xa9fea9fe": "metadata",
    "0xA9.0xFE.0xA9.0xFE": "metadata",
    "169.254.43518": "metadata",
    "169.16689662": "metadata",
    "[::ffff:169.254.169.254]": "metadata",
    "[::ffff:a9fe:a9fe]": "metadata",
    "[64:ff9b::a9fe:a9fe]": "nat64",
    "[2002:a9fe:a9fe::1]": "6to4",
    "[2001:0:4136:e378:8000:63bf:5601:5601]": "teredo",
    "[::169.254.169.254]": "v4compat",
    "[::a9fe:a9fe]": "v4compat",
    "[fd00:ec2::254]": "metadata-v6",
    "100.100.100.200": "cgnat",
    "168.63.129.16": "wireserver",
}
PRIVATE_FORMS = {
    "10.0.0.5": "private",
    "167772165": "private",
    "012.0.0.05": "private",
    "0xa000005": "private",
    "10.5": "private",
    "[::ffff:10.0.0.5]": "private",
}
LOOPBACK_FORMS = {"127.0.0.1": "loopback", "2130706433": "loopback", "0x7f.1": "loopback",
                  "127.1": "loopback", "[::1]": "loopback-v6", "[::ffff:127.0.0.1]": "loopback",
                  "127.0.0.2": "loopback-2", "0x7f000002": "loopback-2",
                  # the unspecified address is dialled as the local host
                  "0.0.0.0": "loopback", "0": "loopback", "0x0": "loopback", "[::]": "loopback-v6",
                  "[::ffff:0.0.0.0]": "loopback"}
ALL_FORMS = {**METADATA_FORMS, **PRIVATE_FORMS, **LOOPBACK_FORMS}
# spellings curl will not dial (so no direct control of their own); each names an address whose
# canary the controls above prove live
ODD_FORMS = ["169.254.169.254.", "0x00000000a9fea9fe", "0251.0xfe.43518", "%31%36%39.254.169.254",
             "169.254.169.254%2f", "[::ffff:169.254.169.254%25eth0]", "[0:0:0:0:0:ffff:a9fe:a9fe]",
             "[::FFFF:A9FE:A9FE]", "①⑥⑨.②⑤④.①⑥⑨.②⑤④", "169。254。169。254", "169%2e254%2e169%2e254",
             "".join(chr(ord(c) + 0xFEE0) if c.isdigit() else c for c in "169.254.169.254")]  # fullwidth


@pytest.mark.parametrize("form", sorted(ALL_FORMS))
def test_positive_control_every_spelling_reaches_its_canary_directly(world: World, form: str) -> None:
    mark = world.mark()
    res = world.curl(world.gw, "--path-as-is", f"http://{form}/control")
    assert res.returncode == 0, res.stderr
    canary = ALL_FORMS[form]
    assert f"CANARY:{canary}" in res.stdout
    assert any(h["event"] == "accept" for h in world.hits(mark, listener=canary))


@pytest.mark.parametrize("form", sorted(ALL_FORMS))
def test_absolute_form_literal_is_denied(world: World, gateway: Gateway, sbx: Sandbox, form: str) -> None:
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx, f"http://{form}/latest/meta-data/")))
    assert_denied(resp, ADDRESS_REASONS)  # allowed by rule: only the address check may refuse it
    assert_untouched(world, mark, form)


@pytest.mark.parametrize("form", sorted(ALL_FORMS))
@pytest.mark.parametrize("port", [80, 443])
def test_connect_literal_is_denied(world: World, gateway: Gateway, sbx: Sandbox, form: str, port: int) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, f"{form}:{port}")
    with sock:
        assert_denied(resp, ADDRESS_REASONS)
    assert_untouched(world, mark, f"CONNECT {form}:{port}")


@pytest.mark.parametrize("form", ODD_FORMS)
def test_odd_spellings_are_denied_everywhere(world: World, gateway: Gateway, sbx: Sandbox, form: str) -> None:
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx, f"http://{form}/latest/meta-data/")))
    assert resp.status >= 400, resp
    sock, resp = gateway.tunnel(sbx, f"{form}:80")
    with sock:
        assert resp.status >= 400, resp
    assert_untouched(world, mark, form)


HOST_FORMS = ["169.254.169.254", "2852039166", "[::ffff:a9fe:a9fe]", "10.0.0.5", "0x7f.1", "[fd00:ec2::254]",
              "[64:ff9b::a9fe:a9fe]"]


@pytest.mark.parametrize("form", HOST_FORMS)
def test_host_header_literal_inside_tunnel_is_refused(
    world: World, gateway: Gateway, sbx: Sandbox, form: str
) -> None:
    """CONNECT to the allowed name, then a Host naming a forbidden literal on the intercepted request."""
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "api.allowed.test:443")
    assert resp.status == 200, resp
    with gateway.tls(sock, "api.allowed.test") as tls:
        tls.sendall(f"GET /latest/meta-data/ HTTP/1.1\r\nHost: {form}\r\nConnection: close\r\n\r\n".encode())
        inner = read_response(tls)
    assert_denied(inner, {"host_mismatch", "invalid_request"}, statuses=(400, 403, 421))
    assert_untouched(world, mark, form)
    assert [h for h in world.hits(mark, listener="upstream-tls") if h["event"] == "request"] == []


@pytest.mark.parametrize("form", HOST_FORMS)
def test_host_header_literal_on_allowed_url_is_denied(
    world: World, gateway: Gateway, sbx: Sandbox, form: str
) -> None:
    """The URL names the allowed upstream, the Host header a forbidden literal: refused, and neither the
    canary nor the upstream sees the forged Host."""
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx, "http://api.allowed.test/", host=form)))
    assert_denied(resp, {"host_mismatch", "invalid_request"}, statuses=(400, 403, 421))
    assert_untouched(world, mark, form)
    assert [h for h in world.hits(mark, listener="upstream-http") if h["event"] == "request"] == []


@pytest.mark.parametrize("form", ["169.254.169.254", "2852039166", "0251.0376.0251.0376", "10.0.0.5"])
def test_origin_form_with_forbidden_host_is_not_proxied(world: World, gateway: Gateway, sbx: Sandbox,
                                                        form: str) -> None:
    """A request line without a URL ("GET / ... Host: 169.254.169.254") sent to the proxy port."""
    mark = world.mark()
    raw = gateway.raw(f"GET /latest/meta-data/ HTTP/1.1\r\nHost: {form}\r\n"
                      f"Proxy-Authorization: {sbx.auth_header}\r\nConnection: close\r\n\r\n".encode())
    if raw:
        assert parse_response(raw).status >= 400
    assert_untouched(world, mark, form)


@pytest.mark.parametrize("form", ["10.0.0.5", "167772165", "0xa000005", "10.5", "012.0.0.05"])
def test_positive_control_gateway_dials_encoded_private_literal_when_allowed(
    world: World, gateway: Gateway, sbx_private: Sandbox, form: str
) -> None:
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx_private, f"http://{form}/allowed-private")))
    assert resp.status == 200, resp
    assert b"CANARY:private" in resp.body
    assert any(h["event"] == "request" for h in world.hits(mark, listener="private"))
    assert nw.NET_CANARIES["private"][0] == "10.0.0.5"


@pytest.mark.parametrize("form", sorted(METADATA_FORMS))
def test_https_absolute_form_literal_is_denied(world: World, gateway: Gateway, sbx: Sandbox, form: str) -> None:
    """`GET https://...` to a plain proxy makes the proxy open the TLS itself: same checks apply."""
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx, f"https://{form}/latest/meta-data/")))
    assert_denied(resp, ADDRESS_REASONS)
    assert_untouched(world, mark, form)


def test_positive_control_https_absolute_form_reaches_allowed_upstream(
    world: World, gateway: Gateway, sbx: Sandbox
) -> None:
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx, "https://api.allowed.test/absolute-https")))
    assert resp.status == 200, resp
    assert [r["target"] for r in world.hits(mark, listener="upstream-tls") if r["event"] == "request"] == [
        "/absolute-https"]


@pytest.mark.parametrize("target", ["http://169.254.169.254:80", "169.254.169.254", "[169.254.169.254]:80",
                                    "169.254.169.254:80/latest", "user@169.254.169.254:80",
                                    "api.allowed.test:443@169.254.169.254:80", "169.254.169.254:80 HTTP/1.0\r\nX:"])
def test_malformed_connect_targets_are_refused(
    world: World, gateway: Gateway, sbx: Sandbox, target: str
) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, target)
    with sock:
        assert resp.status >= 400, resp
    assert_untouched(world, mark, target)
