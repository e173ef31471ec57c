"""`network.dns.deny_answer: gateway` (dns/gateway_answer.py): a denied name resolves to the gateway,
and is never asked upstream (the recording upstream is the DNS canary).

Positive controls: an allowed name is asked upstream and answered with its real address; the same denied
name under `deny_answer: rcode` or with the resolver setting off gets NXDOMAIN.
"""

from __future__ import annotations

import dataclasses
import time

import dns.rdatatype
import pytest

from egressgate.dns.gateway_answer import answer_address, link_peer
from egressgate.dns.server import DnsServer
from egressgate.policy.loader import parse_policy
from egressgate.state.base import SandboxRecord, hash_token
from tests.support.dnsclients import addresses, ask, dig, rcode

RCODE_IP = "127.0.0.10"  # a sandbox under a policy with deny_answer: rcode (link peer 127.0.0.9)
RCODE_POLICY = """
sandbox: {name: dns-rcode}
network:
  dns:
    allow: [allowed.example.com]
    deny_answer: rcode
"""


@pytest.fixture
async def gateway_server(policies, state, audit, dns_config):
    policies = {**policies, "dns-rcode": parse_policy(RCODE_POLICY, "<dns-rcode>")}
    await state.admit(
        SandboxRecord(
            id="sbx-rcode",
            token_hash=hash_token("t"),
            policy_name="dns-rcode",
            admitted_at=time.time(),
            addresses=(RCODE_IP,),
        )
    )
    srv = DnsServer(policies.get, state, audit, dataclasses.replace(dns_config, gateway_answer="auto"))
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.stop()


@pytest.mark.parametrize("tcp", [False, True])
async def test_a_denied_name_resolves_to_the_gateway_without_an_upstream_query(gateway_server, upstream, audit, tcp):
    response = await ask(gateway_server, "c2VjcmV0.exfil.example", tcp=tcp)
    assert rcode(response) == "NOERROR" and addresses(response) == ["127.0.0.1"]  # the link peer of 127.0.0.2
    assert [rrset.ttl for rrset in response.answer] == [10]
    assert upstream.seen == []  # the name never left
    event = audit.events[-1]
    assert (event.decision, event.reason, event.host) == ("deny", "host_not_allowed", "c2vjcmv0.exfil.example")
    assert event.answers == ["A 127.0.0.1"]
    assert event.extra["egressgate.dns.rcode"] == "NOERROR" and event.extra["egressgate.dns.answer"] == "gateway"
    # positive control: an allowed name is asked upstream and answered with its address
    allowed = await ask(gateway_server, "allowed.example.com", tcp=tcp)
    assert addresses(allowed) == ["93.184.216.34"] and upstream.names() == ["allowed.example.com"]


async def test_other_types_of_a_denied_name_get_nodata(gateway_server, upstream):
    for qtype in ("AAAA", "HTTPS"):
        response = await ask(gateway_server, "denied.example", qtype)
        assert rcode(response) == "NOERROR" and response.answer == [], qtype
    assert upstream.seen == []


async def test_the_answer_is_well_formed_for_dig_and_without_edns(gateway_server, upstream):
    out = await dig(gateway_server, "Denied.Example", "A")
    assert "status: NOERROR" in out and "127.0.0.1" in out, out
    plain = await ask(gateway_server, "denied.example", edns=None)
    assert addresses(plain) == ["127.0.0.1"] and plain.edns < 0
    assert [rrset.rdtype for rrset in plain.answer] == [dns.rdatatype.A]
    assert upstream.seen == []


async def test_deny_answer_rcode_keeps_nxdomain(gateway_server, upstream, audit):
    response = await ask(gateway_server, "denied.example", source=RCODE_IP)
    assert rcode(response) == "NXDOMAIN" and addresses(response) == []
    assert "egressgate.dns.answer" not in audit.events[-1].extra
    assert upstream.seen == []


async def test_without_the_resolver_setting_the_deny_rcode_is_answered(server, upstream):
    """The gateway passes `gateway_answer` only when it runs a transparent listener (app.py)."""
    response = await ask(server, "denied.example")
    assert rcode(response) == "NXDOMAIN" and upstream.seen == []


def test_the_link_peer_is_the_host_end_of_the_slot() -> None:
    assert link_peer("198.18.128.2") == "198.18.128.1"  # runtimes/addressing.py: host .1, sandbox .2
    assert link_peer("198.18.128.6") == "198.18.128.5"
    assert link_peer("198.18.128.1") is None  # the host end itself: nowhere to point
    assert link_peer("2001:db8::2") is None
    assert answer_address("192.0.2.7", "198.18.128.2") == "192.0.2.7"
    assert answer_address(None, "198.18.128.2") is None


def test_auto_points_only_clients_of_the_runtime_pool_at_their_link_peer() -> None:
    """Outside the pool (a sandbox admitted with `--address` on some other network) the peer of a /30
    could be another machine: the rcode is answered instead."""
    pool = ("198.18.128.0/17",)
    assert answer_address("auto", "198.18.128.2", pool) == "198.18.128.1"
    assert answer_address("auto", "10.1.2.6", pool) is None
    assert answer_address("192.0.2.7", "10.1.2.6", pool) == "192.0.2.7"  # an explicit address applies to all
