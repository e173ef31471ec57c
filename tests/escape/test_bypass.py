"""The sandbox cannot go around the gateway: no direct connection, no direct DNS, no `--noproxy` retry.

Positive controls: the same sandbox reaches the allowed upstream *through* the gateway (and the
upstream sees the gateway's address, not the sandbox's), and the firewall-less ``open`` namespace in
the same network position reaches every target directly, so the failures below are the sandbox
firewall's doing and not a missing route.
"""

from __future__ import annotations

import socket

import pytest

import tests.networld as nw
from tests.escape.checks import assert_untouched, requests_on
from tests.networld import World
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

DIRECT = [
    "http://169.254.169.254/latest/meta-data/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "https://10.0.0.5/",
    "http://100.100.100.200/",
    "http://168.63.129.16/machine?comp=goalstate",
    f"https://{nw.UPSTREAM}/",
    f"http://{nw.FORBIDDEN_UPSTREAM}/",
]


def test_positive_control_sandbox_reaches_upstream_through_gateway(
    world: World, gateway: Gateway, sbx: Sandbox
) -> None:
    mark = world.mark()
    res = gateway.curl(sbx, "https://api.allowed.test/through-gateway")
    assert res.status == 200, res
    [req] = requests_on(world, mark, "upstream-tls")
    assert req["target"] == "/through-gateway"
    assert req["peer"].startswith(nw.GW_NET + ":"), "the upstream must see the gateway, not the sandbox"


@pytest.mark.parametrize("url", DIRECT)
def test_direct_connection_from_sandbox_fails(world: World, gateway: Gateway, url: str) -> None:
    mark = world.mark()
    res = world.curl(world.sbx, "--noproxy", "*", url)
    assert res.returncode != 0 and "CANARY" not in res.stdout, res
    assert_untouched(world, mark, url)
    assert [h for h in world.hits(mark) if h.get("peer", "").startswith(nw.SBX)] == []
    control = world.curl(world.open, url)
    assert control.returncode == 0, f"positive control: {url} must be reachable without the firewall"


def test_noproxy_retry_of_an_allowed_name_fails(world: World, gateway: Gateway) -> None:
    """An agent that gets a deny and retries with --noproxy: no DNS, no route, nothing leaves."""
    mark = world.mark()
    res = world.curl(world.sbx, "--noproxy", "*", "https://api.allowed.test/")
    assert res.returncode != 0
    assert world.dns_queries(mark) == []
    assert world.hits(mark) == []


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_direct_dns_from_sandbox_fails(world: World, gateway: Gateway, transport: str) -> None:
    mark = world.mark()
    flag = "+tcp" if transport == "tcp" else "+notcp"
    res = world.exec(world.sbx, "dig", flag, "+time=1", "+tries=1", f"@{nw.DNS_ADDR}", "metadata.evil.test")
    assert "169.254.169.254" not in res.stdout
    assert world.dns_queries(mark) == []
    control = world.exec(world.open, "dig", flag, "+short", f"@{nw.DNS_ADDR}", "metadata.evil.test")
    assert control.stdout.split() == ["169.254.169.254"]


def test_sandbox_reaches_only_the_proxy_port_of_the_gateway(world: World, gateway: Gateway) -> None:
    """Other ports on the gateway's own address (and its other interface) are closed to the sandbox."""
    host, port = gateway.proxy
    others = [(host, 80), (host, 53), (nw.GW_NET, port), (host, port + 1)]

    def try_connect(target: tuple[str, int]) -> str:
        try:
            socket.create_connection(target, timeout=3).close()
            return "connected"
        except OSError as exc:
            return type(exc).__name__

    for target in others:
        assert world.in_ns(world.sbx, lambda t=target: try_connect(t)) != "connected", target
    assert world.in_ns(world.sbx, lambda: try_connect(gateway.proxy)) == "connected"
