"""Non-HTTP bytes inside a CONNECT tunnel are refused unless a tcp rule allows that host:port.

Exfiltration through a permitted host: an SSH banner or arbitrary bytes in a tunnel opened to an HTTPS
host. The upstream TLS listener logs any non-TLS first bytes it receives (``non_tls``), the raw listener
logs every chunk, so a relay that let the bytes through is visible. Positive control: under escape-tcp
(tcp rule for api.allowed.test:2222) the same bytes do arrive at the raw listener.
"""

from __future__ import annotations

import time

import pytest

from tests.escape.checks import SETTLE, assert_denied, assert_untouched
from tests.networld import World
from tests.support.http1 import parse_response, read_all
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

PAYLOADS = {
    "ssh": b"SSH-2.0-OpenSSH_9.6 exfil-marker\r\n",
    "binary": b"\x00\x01\x02exfil-marker\xff\xfe" * 4,
    "smtp": b"EHLO exfil-marker\r\n",
}


def _leaked(world: World, mark) -> list[dict]:
    time.sleep(SETTLE)
    return [h for h in world.hits(mark) if "exfil-marker" in str(h.get("data", ""))]


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_non_tls_bytes_in_https_tunnel_are_refused(
    world: World, gateway: Gateway, sbx: Sandbox, payload: str
) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "api.allowed.test:443")
    with sock:
        assert resp.status == 200, resp  # the host:port is allowed; the protocol inside is not
        sock.sendall(PAYLOADS[payload])
        reply = read_all(sock, 1.0, first=10 if payload == "binary" else None)
    assert b"RAW-ACK" not in reply
    if payload == "binary":  # unmistakably not HTTP: refused with the deny contract on the tunnel
        assert_denied(parse_response(reply), {"protocol_not_allowed"})
    assert _leaked(world, mark) == []
    assert_untouched(world, mark, payload)


def test_connect_to_raw_port_without_tcp_rule_is_denied(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "api.allowed.test:2222")
    with sock:
        assert_denied(resp, {"port_not_allowed", "host_not_allowed", "protocol_not_allowed"})
    time.sleep(SETTLE)
    assert world.hits(mark, listener="upstream-raw") == []


def test_non_http_under_tcp_policy_is_still_refused_on_other_ports(world: World, gateway: Gateway) -> None:
    sbx_tcp = gateway.admit("escape-tcp")
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx_tcp, "api.allowed.test:443")
    with sock:
        if resp.status == 200:
            sock.sendall(PAYLOADS["ssh"])
            assert b"RAW-ACK" not in read_all(sock, 1.0)
    assert _leaked(world, mark) == []


def test_positive_control_raw_tcp_allowed_by_tcp_rule(world: World, gateway: Gateway) -> None:
    sbx_tcp = gateway.admit("escape-tcp")
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx_tcp, "api.allowed.test:2222")
    with sock:
        assert resp.status == 200, resp
        sock.sendall(PAYLOADS["ssh"])
        reply = read_all(sock, 1.0, first=10)
    assert reply.startswith(b"RAW-ACK"), reply
    assert _leaked(world, mark), "the raw listener should have logged the bytes"
