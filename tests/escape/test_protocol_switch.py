"""Protocol switch: an allowed request upgrades (101) to a non-HTTP protocol, turning an inspected
HTTP connection into a raw pipe to the upstream. The gateway must not relay raw bytes it never decided
on (no tcp rule). The upstream's /switch answers 101 and then logs every raw byte it receives.
Positive control: directly (no gateway) the raw bytes after the 101 reach the upstream's log.
"""

from __future__ import annotations

import socket
import time

import pytest

import tests.networld as nw
from tests.escape.checks import SETTLE
from tests.networld import World
from tests.support.http1 import read_all, read_response
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

MARKER = b"switch-exfil-marker\n"
UPGRADE = "GET /switch HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: exfil\r\n{auth}\r\n"


def _raw_after_switch(world: World, mark, listener: str) -> list[dict]:
    time.sleep(SETTLE)
    return [h for h in world.hits(mark, listener=listener)
            if h["event"] == "data" and "switch-exfil-marker" in h["data"]]


def test_positive_control_direct_switch_passes_raw_bytes(world: World) -> None:
    mark = world.mark()

    def run() -> bytes:
        with socket.create_connection((nw.UPSTREAM, 80), timeout=5) as sock:
            sock.sendall(UPGRADE.format(host="api.allowed.test", auth="").encode())
            head = read_response(sock)
            assert head.status == 101
            sock.sendall(MARKER)
            return read_all(sock, 0.5, first=5)

    assert world.in_ns(world.gw, run).startswith(b"RAW-ACK")
    assert _raw_after_switch(world, mark, "upstream-http")


def test_plain_http_switch_does_not_become_a_raw_pipe(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    with gateway.connect() as sock:
        req = UPGRADE.format(host="api.allowed.test", auth=f"Proxy-Authorization: {sbx.auth_header}\r\n")
        sock.sendall(req.replace("GET /switch", "GET http://api.allowed.test/switch").encode())
        first = read_all(sock, 1.0, first=10)
        try:
            sock.sendall(MARKER)
            later = read_all(sock, 1.0)
        except OSError:
            later = b""
    assert b"RAW-ACK" not in first + later
    assert _raw_after_switch(world, mark, "upstream-http") == []


def test_tunnel_switch_does_not_become_a_raw_pipe(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "api.allowed.test:443")
    assert resp.status == 200, resp
    with gateway.tls(sock, "api.allowed.test") as tls:
        tls.sendall(UPGRADE.format(host="api.allowed.test", auth="").encode())
        first = read_all(tls, 1.0, first=10)
        try:
            tls.sendall(MARKER)
            later = read_all(tls, 1.0)
        except OSError:
            later = b""
    assert b"RAW-ACK" not in first + later
    assert _raw_after_switch(world, mark, "upstream-tls") == []
