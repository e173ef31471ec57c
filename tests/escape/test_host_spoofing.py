"""Host header spoofing and authority tricks on the plain-HTTP (absolute-form) proxy path.

A gateway that decides by the URL but lets the Host header through (or decides by Host, mitmproxy's
``pretty_host``) sends a request to one server that names another. The receiving side is asserted:
forbidden-http never gets a connection, upstream-http never gets a request naming another host, the
canaries stay untouched. Positive controls: the consistent request goes through, and forbidden.test is
reachable under escape-forbidden (its listener is live).
"""

from __future__ import annotations

import time

import pytest

from tests.escape.checks import ADDRESS_REASONS, SETTLE, assert_denied, assert_untouched, proxied_get, requests_on
from tests.networld import World
from tests.support.http1 import parse_response
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

SPOOF_REASONS = {"host_mismatch", "invalid_request"}


def _upstream_saw_only_allowed(world: World, mark) -> None:
    time.sleep(SETTLE)
    assert world.hits(mark, listener="forbidden-http") == []
    same = {"api.allowed.test", "api.allowed.test.", "api.allowed.test:80"}
    odd = [r for r in requests_on(world, mark, "upstream-http") if (r["host"] or "").lower() not in same]
    assert odd == [], f"upstream received a spoofed Host: {odd}"


def test_positive_control_plain_http_allowed(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx, "http://api.allowed.test/plain")))
    assert resp.status == 200, resp
    [req] = requests_on(world, mark, "upstream-http")
    assert (req["host"], req["target"]) == ("api.allowed.test", "/plain")
    assert not any(n.lower() == "proxy-authorization" for n, _ in req["headers"]), "credentials leaked upstream"


@pytest.mark.parametrize("host", ["forbidden.test", "169.254.169.254", "metadata.google.internal",
                                  "api.allowed.test:8080", "api.allowed.test.", "api.allowed.test@forbidden.test",
                                  "forbidden.test#api.allowed.test"])
def test_spoofed_host_header_is_refused(world: World, gateway: Gateway, sbx: Sandbox, host: str) -> None:
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx, "http://api.allowed.test/spoof", host=host)))
    if host == "api.allowed.test.":  # the same name in absolute DNS form may be accepted
        assert resp.status in (200, 400, 403, 421), resp
    else:
        assert_denied(resp, SPOOF_REASONS, statuses=(400, 403, 421))
    _upstream_saw_only_allowed(world, mark)
    assert_untouched(world, mark, host)


def test_duplicate_host_headers_are_refused(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    extra = "Host: forbidden.test\r\n"
    raw = gateway.raw(proxied_get(sbx, "http://api.allowed.test/dup", extra=extra))
    resp = parse_response(raw)
    assert resp.status in (400, 403, 421), resp
    _upstream_saw_only_allowed(world, mark)


def test_forbidden_url_with_allowed_host_header_is_denied(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx, "http://forbidden.test/x", host="api.allowed.test")))
    assert_denied(resp, SPOOF_REASONS | {"host_not_allowed"}, statuses=(400, 403, 421))
    _upstream_saw_only_allowed(world, mark)


@pytest.mark.parametrize("url", [
    "http://api.allowed.test@169.254.169.254/latest/meta-data/",
    "http://api.allowed.test:80@169.254.169.254/",
    "http://169.254.169.254#@api.allowed.test/",
    "http://169.254.169.254\\@api.allowed.test/",
    "http://api.allowed.test%40169.254.169.254/",
])
def test_userinfo_and_authority_confusion_is_refused(
    world: World, gateway: Gateway, sbx: Sandbox, url: str
) -> None:
    mark = world.mark()
    raw = gateway.raw(proxied_get(sbx, url, host="api.allowed.test"))
    if raw:
        resp = parse_response(raw)
        assert resp.status >= 400, resp
        if resp.denied:
            assert_denied(resp, SPOOF_REASONS | ADDRESS_REASONS | {"host_not_allowed"}, statuses=(400, 403, 421))
    assert_untouched(world, mark, url)
    _upstream_saw_only_allowed(world, mark)


def test_positive_control_forbidden_http_is_live_when_allowed(world: World, gateway: Gateway) -> None:
    sbx_f = gateway.admit("escape-forbidden")
    mark = world.mark()
    resp = parse_response(gateway.raw(proxied_get(sbx_f, "http://forbidden.test/control")))
    assert resp.status == 200, resp
    assert requests_on(world, mark, "forbidden-http")


@pytest.mark.parametrize("url", ["ws://169.254.169.254/", "HTTP://169.254.169.254/", "http:/169.254.169.254/",
                                 "http:169.254.169.254/", "//169.254.169.254/", "ftp://169.254.169.254/",
                                 "http://169.254.169.254:80:80/", "http://[169.254.169.254]/"])
def test_odd_absolute_forms_are_refused(world: World, gateway: Gateway, sbx: Sandbox, url: str) -> None:
    mark = world.mark()
    raw = gateway.raw(proxied_get(sbx, url, host="api.allowed.test"))
    if raw and url.startswith("//"):
        # origin-form ("//..." is a path): routed and decided by the Host header, which names the
        # allowed upstream; the path is just a path there. Only that upstream may see it.
        assert parse_response(raw).status in (200, 400, 403, 421)
    elif raw:
        assert parse_response(raw).status >= 400
    assert_untouched(world, mark, url)
    _upstream_saw_only_allowed(world, mark)


_LINE = "GET http://api.allowed.test/h HTTP/1.1\r\n"
_END = "Connection: close\r\n{auth}\r\n"
HEADER_TRICKS = {
    "lf-only": "GET http://api.allowed.test/h HTTP/1.1\nHost: 169.254.169.254\nConnection: close\n{auth}\n",
    "bare-cr": _LINE + "Host: api.allowed.test\rHost: 169.254.169.254\r\n" + _END,
    "space-before-colon": _LINE + "Host : 169.254.169.254\r\n" + _END,
    "tab": _LINE + "Host:\t169.254.169.254\r\n" + _END,
    "obs-fold": _LINE + "Host: api.allowed.test\r\n 169.254.169.254\r\n" + _END,
    "nul": _LINE + "Host: api.allowed.test\x00169.254.169.254\r\n" + _END,
    "lowercase-dup": _LINE + "Host: api.allowed.test\r\nhost: forbidden.test\r\n" + _END,
}


@pytest.mark.parametrize("trick", sorted(HEADER_TRICKS))
def test_header_syntax_tricks_never_retarget(world: World, gateway: Gateway, sbx: Sandbox, trick: str) -> None:
    mark = world.mark()
    payload = HEADER_TRICKS[trick].format(auth=f"Proxy-Authorization: {sbx.auth_header}" + (
        "\n" if trick == "lf-only" else "\r\n"))
    raw = gateway.raw(payload.encode())
    if raw:
        status = parse_response(raw).status
        assert status >= 400 or trick == "lf-only", raw[:200]  # LF-only is tolerated by RFC 9112 2.2
    assert_untouched(world, mark, trick)
    _upstream_saw_only_allowed(world, mark)
