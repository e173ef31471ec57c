"""Exfiltration through a permitted host: the host is allowed, the method/path is not.

other.allowed.test allows only GET; a POST carrying data must be refused *before* any byte of the body
reaches the upstream, including on a keep-alive tunnel whose earlier request was allowed (each request
is decided on its own). Positive control: the same POST to api.allowed.test (POST allowed) arrives
with its body, so the upstream log would show a leak.
"""

from __future__ import annotations

import time

import pytest

from tests.escape.checks import SETTLE, assert_denied, requests_on
from tests.networld import World
from tests.support.http1 import read_response
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

MARKER = "exfil-marker-7f3a"


def _leaks(world: World, mark) -> list[dict]:
    time.sleep(SETTLE)
    return [r for r in requests_on(world, mark, "upstream-tls") + requests_on(world, mark, "upstream-http")
            if MARKER in r["body"] or MARKER in r["target"]]


def test_positive_control_post_to_post_allowed_host_arrives(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    res = gateway.curl(sbx, "https://api.allowed.test/upload", "-d", f"secret={MARKER}")
    assert res.status == 200, res
    assert _leaks(world, mark), "control: the allowed POST's body should reach the upstream"


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_disallowed_method_on_allowed_host_sends_nothing(
    world: World, gateway: Gateway, sbx: Sandbox, method: str
) -> None:
    mark = world.mark()
    res = gateway.curl(sbx, "https://other.allowed.test/upload", "-X", method, "-d", f"secret={MARKER}")
    assert_denied(res, {"method_not_allowed"})
    assert _leaks(world, mark) == []


def test_keepalive_tunnel_decides_every_request(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    """GET (allowed), POST with data (denied), GET (allowed) on one intercepted tunnel."""
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "other.allowed.test:443")
    assert resp.status == 200, resp
    statuses = []
    with gateway.tls(sock, "other.allowed.test") as tls:
        for method, body in (("GET", ""), ("POST", f"secret={MARKER}"), ("GET", "")):
            tls.sendall(f"{method} /ka HTTP/1.1\r\nHost: other.allowed.test\r\nContent-Length: {len(body)}\r\n"
                        f"\r\n{body}".encode())
            inner = read_response(tls)
            statuses.append(inner.status)
            if method == "POST":
                assert_denied(inner, {"method_not_allowed"})
                if inner.headers.get("connection", "").lower() == "close":
                    break
    assert statuses[0] == 200 and statuses[1] == 403, statuses
    assert _leaks(world, mark) == []
    assert [r["method"] for r in requests_on(world, mark, "upstream-tls")] == ["GET"] * statuses.count(200)


def test_query_string_exfil_on_denied_path_is_not_forwarded(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    """A GET is allowed on other.allowed.test, so data in the URL goes through: that is policy, not a
    bypass. But a denied method never forwards its URL either."""
    mark = world.mark()
    res = gateway.curl(sbx, f"https://other.allowed.test/q?d={MARKER}", "-X", "POST")
    assert_denied(res, {"method_not_allowed"})
    assert _leaks(world, mark) == []
