"""Issue 9 item 7: every embedded IPv4 of a multi-candidate IPv6 form must pass allow_private.

Teredo carries two IPv4 addresses (server, client) and a ``64:ff9b:1::/48`` local-use NAT64 address is
decoded at four RFC 6052 positions. Opening one of them with ``allow_private`` must not open the others:
each non-global candidate is checked. Positive control in every case: when allow_private covers all the
non-global candidates, the address IS permitted (the check is not simply "refuse every embedded form").
"""

from __future__ import annotations

import ipaddress
import textwrap
from ipaddress import IPv4Address, IPv6Address, ip_network

import pytest

from egressgate.policy.addr import AddrClass, check_address, classify
from egressgate.policy.decide import decide
from egressgate.policy.facts import SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.reasons import Reason
from egressgate.policy.target import parse_target

TEN = ip_network("10.0.0.0/8")
LOOP = ip_network("127.0.0.0/8")


def teredo(server: str, client: str) -> IPv6Address:
    """2001:0::/32 + server IPv4 + flags/port 0 + client IPv4 inverted (RFC 4380)."""
    s, c = int(IPv4Address(server)), int(IPv4Address(client)) ^ 0xFFFFFFFF
    return IPv6Address((0x2001_0000 << 96) | (s << 64) | c)


def nat64_local(octets: bytes) -> IPv6Address:
    """64:ff9b:1::/48 followed by bytes 6..15 exactly as given (byte 8 is RFC 6052's u octet)."""
    assert len(octets) == 10
    return IPv6Address(bytes.fromhex("0064ff9b0001") + octets)


# /48 -> b6 b7 b9 b10, /56 -> b7 b9 b10 b11, /64 -> b9..b12, /96 -> b12..b15
# 10.10.10.10 at /48 and /56, 10.10.10.127 at /64, 127.0.0.1 at /96.
NAT64_MIXED = nat64_local(bytes([10, 10, 0, 10, 10, 10, 127, 0, 0, 1]))

# (address, allow_private that covers only SOME non-global candidates, the class that must refuse it)
PARTIAL = [
    pytest.param(teredo("10.0.0.1", "127.0.0.1"), (TEN,), AddrClass.LOOPBACK, id="teredo-server-covered"),
    pytest.param(teredo("127.0.0.1", "10.0.0.1"), (TEN,), AddrClass.LOOPBACK, id="teredo-client-covered"),
    pytest.param(teredo("10.0.0.1", "192.168.1.1"), (TEN,), AddrClass.PRIVATE, id="teredo-other-private"),
    pytest.param(teredo("10.0.0.1", "0.0.0.0"), (TEN,), AddrClass.UNSPECIFIED, id="teredo-client-unspecified"),
    pytest.param(teredo("10.0.0.1", "169.254.169.254"), (TEN,), AddrClass.METADATA, id="teredo-client-metadata"),
    pytest.param(NAT64_MIXED, (TEN,), AddrClass.LOOPBACK, id="nat64-local-96-uncovered"),
]


@pytest.mark.parametrize(("address", "allow", "refused_as"), PARTIAL)
def test_a_partly_covered_embedded_form_is_refused(address, allow, refused_as) -> None:
    verdict = check_address(address, allow)
    assert verdict is not None and verdict.addr_class is refused_as, verdict


@pytest.mark.parametrize(
    ("address", "allow"),
    [
        pytest.param(teredo("10.0.0.1", "127.0.0.1"), (TEN, LOOP), id="teredo-both-covered"),
        pytest.param(teredo("10.0.0.1", "8.8.8.8"), (TEN,), id="teredo-client-global"),
        pytest.param(teredo("8.8.8.8", "10.0.0.1"), (TEN,), id="teredo-server-global"),
        pytest.param(NAT64_MIXED, (TEN, LOOP), id="nat64-local-all-covered"),
    ],
)
def test_positive_control_fully_covered_embedded_form_is_permitted(address, allow) -> None:
    assert check_address(address, allow) is None
    assert check_address(address, ()) is not None  # and it is refused without allow_private


def test_classification_names_every_non_global_candidate() -> None:
    verdict = classify(NAT64_MIXED)
    parts = [(str(p.embedded), p.via) for p in (verdict, *verdict.others)]
    assert parts == [
        ("10.10.10.10", "nat64_local/48"),
        ("10.10.10.10", "nat64_local/56"),
        ("10.10.10.127", "nat64_local/64"),
        ("127.0.0.1", "nat64_local/96"),
    ]


def test_the_most_severe_candidate_decides_the_class() -> None:
    # A private server first in position order, the never-permitted unspecified client wins the class.
    assert classify(teredo("10.0.0.1", "0.0.0.0")).addr_class is AddrClass.UNSPECIFIED
    assert classify(teredo("10.0.0.1", "169.254.169.254")).addr_class is AddrClass.METADATA


POLICY = parse_policy(textwrap.dedent(f"""
    sandbox: {{name: embedded}}
    network:
      allow_private: [10.0.0.0/8]
      https:
        allow:
          - {{id: teredo-lit, host: "{teredo('10.0.0.1', '127.0.0.1')}"}}
          - {{id: teredo-ok, host: "{teredo('10.0.0.1', '8.8.8.8')}"}}
          - {{id: nat64-lit, host: "{NAT64_MIXED}"}}
"""), "embedded.yaml")


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        (teredo("10.0.0.1", "127.0.0.1"), Reason.ADDRESS_FORBIDDEN),
        (NAT64_MIXED, Reason.ADDRESS_FORBIDDEN),
        (teredo("10.0.0.1", "8.8.8.8"), Reason.RULE_MATCHED),  # positive control
    ],
)
def test_decide_checks_every_embedded_candidate(address, reason) -> None:
    facts = parse_target(f"GET https://[{address}]/x", ())
    decision = decide(POLICY, facts, SandboxState("sbx", 0.0), 1.0)
    assert decision.reason is reason, decision
    # the same address as a resolved address of an allowed name
    resolved = parse_target("GET https://x.example/", (ipaddress.ip_address(address),))
    verdict = check_address(resolved.addresses[0], POLICY.allow_private)
    assert (verdict is None) == (reason is Reason.RULE_MATCHED)
