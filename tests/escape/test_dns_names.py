"""Allowed names whose DNS answers point at forbidden addresses (served by the world's test resolver).

The policy allows ``*.evil.test`` by rule, so the name check passes and only "resolve once, check every
address, pin" can stop the request. Positive controls: the resolver log shows the gateway asked for the
name and was handed the forbidden address (the attack was really delivered), every canary is live
(test_world), and under escape-private the gateway dials private.evil.test's canary.
"""

from __future__ import annotations

import pytest

from tests.escape.checks import ADDRESS_REASONS, assert_denied, assert_untouched
from tests.networld import World
from tests.support.netgateway import Gateway, Sandbox

pytestmark = pytest.mark.netns

# name -> (record type the gateway must ask for, forbidden answer it receives)
NAMES = {
    "loopback.evil.test": ("A", "127.0.0.1"),
    "private.evil.test": ("A", "10.0.0.5"),
    "metadata.evil.test": ("A", "169.254.169.254"),
    "cgnat.evil.test": ("A", "100.100.100.200"),
    "wireserver.evil.test": ("A", "168.63.129.16"),
    "mapped.evil.test": ("AAAA", "::ffff:169.254.169.254"),
    "v6meta.evil.test": ("AAAA", "fd00:ec2::254"),
    "nat64.evil.test": ("AAAA", "64:ff9b::a9fe:a9fe"),
    "mixed.evil.test": ("A", "169.254.169.254"),  # one good and one forbidden answer
}


def _delivered(world: World, mark, name: str) -> None:
    qtype, bad = NAMES[name]
    answers = [q for q in world.dns_queries(mark) if q["qname"] == name and q["qtype"] == qtype]
    assert any(bad in q["answers"] for q in answers), \
        f"the gateway never received the forbidden answer for {name}: {world.dns_queries(mark)}"


@pytest.mark.parametrize("name", sorted(NAMES))
def test_plain_http_to_name_resolving_forbidden_is_denied(
    world: World, gateway: Gateway, sbx: Sandbox, name: str
) -> None:
    mark = world.mark()
    res = gateway.curl(sbx, f"http://{name}/latest/meta-data/")
    assert_denied(res, ADDRESS_REASONS)
    assert_untouched(world, mark, name)
    _delivered(world, mark, name)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_connect_to_name_resolving_forbidden_is_denied(
    world: World, gateway: Gateway, sbx: Sandbox, name: str
) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, f"{name}:443")
    with sock:
        assert_denied(resp, ADDRESS_REASONS)
    assert_untouched(world, mark, name)
    _delivered(world, mark, name)


def test_positive_control_gateway_dials_private_name_when_allowed(
    world: World, gateway: Gateway, sbx_private: Sandbox
) -> None:
    mark = world.mark()
    res = gateway.curl(sbx_private, "http://private.evil.test/control")
    assert res.status == 200, res
    assert "CANARY:private" in res.body
    assert any(h["event"] == "request" for h in world.hits(mark, listener="private"))
