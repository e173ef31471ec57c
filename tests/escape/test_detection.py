"""The detectors detect: the same escape attempts through a *naive* proxy (bare mitmdump, no policy) in
the gateway's place do hit the canaries and the forbidden upstream.

Without this, every "canary untouched" above could be vacuous (a canary the sandbox position can never
reach, a log nobody writes). Here the sandbox namespace, the firewall opening for the proxy port, the
world's resolver and the hit logs are exactly the ones the escape tests use; only the proxy differs.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.escape.checks import proxied_get, requests_on
from tests.networld import GW_SBX, World
from tests.support.env import free_port
from tests.support.http1 import parse_response, read_all

pytestmark = pytest.mark.netns

MITMDUMP = str(Path(sys.executable).with_name("mitmdump"))


@pytest.fixture(scope="module")
def naive_proxy(world: World) -> Iterator[tuple[str, int]]:
    port = world.in_ns(world.gw, lambda: free_port(GW_SBX))
    proc = world.popen(world.gw, MITMDUMP, "-q", "--mode", f"regular@{GW_SBX}:{port}", "--ssl-insecure",
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        world.allow_sandbox_to(GW_SBX, port)
        deadline = time.monotonic() + 30
        while not world.in_ns(world.sbx, lambda: _can_connect((GW_SBX, port))):
            assert time.monotonic() < deadline, "mitmdump did not start"
            time.sleep(0.2)
        yield GW_SBX, port
    finally:
        proc.terminate()
        proc.wait(10)


def _can_connect(addr: tuple[str, int]) -> bool:
    try:
        socket.create_connection(addr, timeout=1).close()
        return True
    except OSError:
        return False


def _send(world: World, proxy: tuple[str, int], payload: bytes) -> bytes:
    def run() -> bytes:
        with socket.create_connection(proxy, timeout=5) as sock:
            sock.sendall(payload)
            return read_all(sock, 1.0, first=10)
    return world.in_ns(world.sbx, run)


@pytest.mark.parametrize(("url", "canary"), [
    ("http://2852039166/latest/meta-data/", "metadata"),
    ("http://[::ffff:a9fe:a9fe]/", "metadata"),
    ("http://metadata.evil.test/", "metadata"),
    ("http://private.evil.test/", "private"),
    ("http://metadata.google.internal/computeMetadata/v1/", "metadata"),
    ("http://[64:ff9b::a9fe:a9fe]/", "nat64"),
])
def test_naive_proxy_lets_the_sandbox_hit_the_canary(
    world: World, naive_proxy: tuple[str, int], url: str, canary: str
) -> None:
    mark = world.mark()
    resp = parse_response(_send(world, naive_proxy, proxied_get(None, url)))
    assert resp.status == 200 and f"CANARY:{canary}".encode() in resp.body, resp
    assert any(h["event"] == "accept" for h in world.hits(mark, listener=canary))


def test_naive_proxy_lets_a_spoofed_host_reach_the_upstream(world: World, naive_proxy: tuple[str, int]) -> None:
    mark = world.mark()
    _send(world, naive_proxy, proxied_get(None, "http://api.allowed.test/spoof", host="forbidden.test"))
    assert [r["host"] for r in requests_on(world, mark, "upstream-http")] == ["forbidden.test"]


def test_naive_connect_reaches_the_metadata_canary(world: World, naive_proxy: tuple[str, int]) -> None:
    mark = world.mark()
    reply = _send(world, naive_proxy, b"CONNECT 0251.0376.0251.0376:80 HTTP/1.1\r\n\r\n"
                  b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert b"CANARY:metadata" in reply
    assert world.canary_hits(mark)
