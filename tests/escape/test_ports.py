"""Port confusion: a port spelled so that a sloppy parser decides one port and dials another.

escape-https allows api.allowed.test on 443 (https) and 80/8080 (http) only; 198.18.1.10:2222 is a raw
listener that logs every connection. 67758 = 2222 + 65536 wraps to 2222 in a 16-bit port. Whatever the
gateway answers, upstream-raw must never see a connection. Positive control: under escape-tcp the
gateway does reach upstream-raw on 2222 (so a wrong dial would be recorded).
"""

from __future__ import annotations

import time

import pytest

from tests.escape.checks import SETTLE, proxied_get
from tests.networld import World
from tests.support.http1 import parse_response
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

CONNECT_FORMS = ["api.allowed.test:67758", "api.allowed.test:02222", "api.allowed.test:+2222",
                 "api.allowed.test:0x8ae", "api.allowed.test:443:2222", "api.allowed.test:2222:443",
                 "api.allowed.test: 2222", "api.allowed.test:2222.0", "api.allowed.test:4294969518",
                 "api.allowed.test:2222#443", "api.allowed.test:443@api.allowed.test:2222"]
URL_FORMS = ["http://api.allowed.test:67758/", "http://api.allowed.test:02222/", "http://api.allowed.test:80:2222/",
             "http://api.allowed.test:4294969518/", "http://api.allowed.test:2222/"]


def _raw_untouched(world: World, mark) -> None:
    time.sleep(SETTLE)
    assert world.hits(mark, listener="upstream-raw") == []


@pytest.mark.parametrize("target", CONNECT_FORMS)
def test_connect_port_confusion_never_dials_raw_port(
    world: World, gateway: Gateway, sbx: Sandbox, target: str
) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, target)
    with sock:
        assert resp.status >= 400, resp
    _raw_untouched(world, mark)


@pytest.mark.parametrize("url", URL_FORMS)
def test_url_port_confusion_never_dials_raw_port(world: World, gateway: Gateway, sbx: Sandbox, url: str) -> None:
    mark = world.mark()
    raw = gateway.raw(proxied_get(sbx, url, host="api.allowed.test"))
    if raw:
        assert parse_response(raw).status >= 400
    _raw_untouched(world, mark)


def test_positive_control_raw_port_is_live_when_allowed(world: World, gateway: Gateway) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(gateway.admit("escape-tcp"), "api.allowed.test:2222")
    with sock:
        assert resp.status == 200, resp
        sock.sendall(b"ping\n")
        assert sock.recv(100).startswith(b"RAW-ACK")
    assert world.hits(mark, listener="upstream-raw")
