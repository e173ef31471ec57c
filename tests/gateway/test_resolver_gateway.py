"""The real gateway (`upstream.resolver` = a scripted DNS server, tests/gateway/scripted_dns.py) against a
hostile or broken upstream, watched from the world's real upstream and canary (127.0.0.2, see conftest.py):
a truncated answer is followed over TCP; a private answer that came over TCP is still refused by pinning;
a record planted for another owner or a forged reply never becomes the dialed address; silence denies
`upstream_unresolvable`. Each test has its control (the untampered answer reaches its target).
"""

from __future__ import annotations

import json
import time

import pytest

from tests.support.gwworld import connect_tunnel, start_gateway, tls_wrap
from tests.support.http1 import read_reply
from tests.support.launcher import stop_gateway
from tests.support.scripted_dns import CANARY, REAL, Plan


@pytest.fixture(scope="module")
def dns_gateway(world, scripted, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gwresolver")
    gw = start_gateway(world, tmp, {"upstream": {
        "resolver": f"127.0.0.1:{scripted.port}", "ca_bundle": str(tmp / "upstream-ca.pem"),
        "connect_timeout": 1.0}})
    try:
        yield gw
    finally:
        stop_gateway(gw)


def fetch(gateway, sbx, host: str, port: int) -> tuple[int, dict]:
    """CONNECT host:port, TLS, one GET /echo: (status, deny body or {})."""
    sock, head = connect_tunnel(gateway, sbx, f"{host}:{port}")
    status = int(head.split(b" ")[1])
    if status != 200:
        sock.close()
        body = head.partition(b"\r\n\r\n")[2]
        return status, json.loads(body) if body else {}
    tls = tls_wrap(sock, gateway, host)
    tls.sendall(f"GET /echo HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    status, _, body = read_reply(tls)
    tls.close()
    return status, {}


def test_gateway_follows_a_truncated_answer_over_tcp(dns_gateway, scripted, world):
    """Fails on a UDP-only client (the gateway denied `upstream_unresolvable`)."""
    scripted.plans["api.test"] = Plan([("", "A", REAL)], mode="tc", ttl=0)
    mark = world.hits.mark()
    sbx = dns_gateway.admit("gw-basic")
    assert fetch(dns_gateway, sbx, "api.test", world.https_port) == (200, {})
    assert len(world.hits.since(mark)) == 1
    assert scripted.queries("api.test", "tcp") >= 1


def test_gateway_still_refuses_a_private_answer_that_came_over_tcp(dns_gateway, scripted, world):
    scripted.plans["canary.test"] = Plan([("", "A", CANARY)], mode="tc", ttl=0)
    mark = world.canary.mark()
    status, body = fetch(dns_gateway, dns_gateway.admit("gw-basic"), "canary.test", world.canary_https_port)
    assert (status, body.get("reason")) == (403, "address_forbidden")
    assert world.canary.since(mark) == []
    # control: where the canary's address is allowed, the same answer does reach it
    status, _ = fetch(dns_gateway, dns_gateway.admit("canary-open"), "canary.test", world.canary_https_port)
    assert status == 200 and len(world.canary.since(mark)) == 1


def test_gateway_dials_no_address_planted_for_another_owner(dns_gateway, scripted, world):
    """The planted record (canary) comes first in the answer section; under a policy that would let the
    gateway dial it, only the asked name's own address is used. Fails on a client that takes every A
    record of the answer (the canary got the request)."""
    scripted.plans["rebind.test"] = Plan([("canary.test", "A", CANARY), ("", "A", REAL)], ttl=0)
    mark, canary_mark = world.hits.mark(), world.canary.mark()
    status, _ = fetch(dns_gateway, dns_gateway.admit("canary-open"), "rebind.test", world.https_port)
    assert status == 200
    assert world.canary.since(canary_mark) == [] and len(world.hits.since(mark)) == 1
    # control: owned by the asked name, the canary address is dialed (the canary listens on that port)
    scripted.plans["rebind.test"] = Plan([("", "A", CANARY)], ttl=0)
    status, _ = fetch(dns_gateway, dns_gateway.admit("canary-open"), "rebind.test", world.https_port)
    assert status == 200 and len(world.canary.since(canary_mark)) == 1


@pytest.mark.parametrize("mode", ["silent", "tc-hang"])
def test_gateway_denies_when_the_dns_server_does_not_answer(dns_gateway, scripted, world, mode):
    scripted.plans["other.test"] = Plan([("", "A", REAL)], mode=mode, ttl=0)
    mark = world.hits.mark()
    started = time.monotonic()
    status, body = fetch(dns_gateway, dns_gateway.admit("gw-basic"), "other.test", world.https_port)
    assert (status, body.get("reason")) == (403, "upstream_unresolvable")
    assert time.monotonic() - started < 5
    assert world.hits.since(mark) == []
    # control: the same name answered normally goes through
    scripted.plans["other.test"] = Plan([("", "A", REAL)], ttl=0)
    assert fetch(dns_gateway, dns_gateway.admit("gw-basic"), "other.test", world.https_port) == (200, {})


@pytest.mark.parametrize("forge", ["id", "question", "source"])
def test_gateway_dials_no_address_from_a_forged_reply(dns_gateway, scripted, world, forge):
    """A forged reply naming the canary arrives before the real one; under a policy that would let the
    gateway dial the canary, only the real answer is used. Control: the same reply untampered wins."""
    scripted.plans["rebind.test"] = Plan([("", "A", REAL)], ttl=0, forge=forge)
    mark, canary_mark = world.hits.mark(), world.canary.mark()
    status, _ = fetch(dns_gateway, dns_gateway.admit("canary-open"), "rebind.test", world.https_port)
    assert status == 200
    assert world.canary.since(canary_mark) == [] and len(world.hits.since(mark)) == 1
    scripted.plans["rebind.test"] = Plan([("", "A", REAL)], ttl=0, forge="control")
    status, _ = fetch(dns_gateway, dns_gateway.admit("canary-open"), "rebind.test", world.https_port)
    assert status == 200 and len(world.canary.since(canary_mark)) == 1
