"""Address classification tables and properties (egressgate.policy.addr).

Includes every case of smokescreen's TestClassifyAddr (and its allow-private / IP-filter tests) mapped
onto our model: smokescreen's "allow ranges" are our `allow_private`; its per-port allow/deny addresses
(8.8.8.8:321, 1.1.1.1) are policy rules, decided in decide.py, not address classes.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressgate.policy.addr import (
    METADATA_ADDRESSES,
    METADATA_HOSTNAMES,
    NEVER_PERMITTED,
    AddrClass,
    Classification,
    check_address,
    classify,
    is_metadata_hostname,
)
from egressgate.policy.canon import CanonError, canon_host, parse_ip_literal
from egressgate.policy.reasons import Reason

G = AddrClass.GLOBAL

CLASSES = [
    # global
    ("8.8.8.8", G),
    ("1.1.1.1", G),
    ("93.184.216.34", G),
    ("100.63.255.255", G),
    ("100.128.0.0", G),
    ("172.15.255.255", G),
    ("172.32.0.0", G),
    ("192.0.1.255", G),
    ("198.17.255.255", G),
    ("198.20.0.0", G),
    ("223.255.255.255", G),
    ("2606:4700:4700::1111", G),
    ("2001:4860:4860::8888", G),
    ("2001:200::1", G),  # just above 2001::/23
    # loopback, unspecified, this network
    ("127.0.0.1", AddrClass.LOOPBACK),
    ("127.255.255.255", AddrClass.LOOPBACK),
    ("127.0.1.1", AddrClass.LOOPBACK),
    ("::1", AddrClass.LOOPBACK),
    ("0.0.0.0", AddrClass.UNSPECIFIED),
    ("::", AddrClass.UNSPECIFIED),
    ("0.0.0.1", AddrClass.THIS_NETWORK),
    ("0.255.255.255", AddrClass.THIS_NETWORK),
    # RFC 1918, CGNAT
    ("10.0.0.1", AddrClass.PRIVATE),
    ("10.255.255.255", AddrClass.PRIVATE),
    ("172.16.0.1", AddrClass.PRIVATE),
    ("172.31.255.255", AddrClass.PRIVATE),
    ("192.168.0.1", AddrClass.PRIVATE),
    ("100.64.0.1", AddrClass.CGNAT),
    ("100.127.255.255", AddrClass.CGNAT),
    # link-local
    ("169.254.0.1", AddrClass.LINK_LOCAL),
    ("169.254.169.1", AddrClass.LINK_LOCAL),
    ("169.254.255.255", AddrClass.LINK_LOCAL),
    ("fe80::1", AddrClass.LINK_LOCAL),
    ("febf:ffff::1", AddrClass.LINK_LOCAL),
    ("fe80::1%eth0", AddrClass.LINK_LOCAL),
    # ULA, site-local
    ("fc00::1", AddrClass.ULA),
    ("fd12:3456::1", AddrClass.ULA),
    ("fd00:ec3::254", AddrClass.ULA),
    ("fec0::1", AddrClass.SITE_LOCAL),
    # multicast, broadcast, reserved
    ("224.0.0.1", AddrClass.MULTICAST),
    ("239.255.255.250", AddrClass.MULTICAST),
    ("ff02::2", AddrClass.MULTICAST),
    ("ff02:0:0:0:0:0:0:2", AddrClass.MULTICAST),
    ("ff0e::1", AddrClass.MULTICAST),
    ("255.255.255.255", AddrClass.BROADCAST),
    ("240.0.0.1", AddrClass.RESERVED),
    ("255.255.255.254", AddrClass.RESERVED),
    ("192.88.99.1", AddrClass.RESERVED),
    ("4000::1", AddrClass.RESERVED),
    ("1::1", AddrClass.RESERVED),
    ("::2:0:0:1", AddrClass.RESERVED),
    ("5f00::1", AddrClass.RESERVED),
    # benchmark, documentation, protocol assignments, discard, orchid
    ("198.18.0.1", AddrClass.BENCHMARK),
    ("198.19.255.255", AddrClass.BENCHMARK),
    ("2001:2::1", AddrClass.BENCHMARK),
    ("192.0.2.1", AddrClass.DOCUMENTATION),
    ("198.51.100.1", AddrClass.DOCUMENTATION),
    ("203.0.113.1", AddrClass.DOCUMENTATION),
    ("2001:db8::1", AddrClass.DOCUMENTATION),
    ("3fff::1", AddrClass.DOCUMENTATION),
    ("3fff:fff::1", AddrClass.DOCUMENTATION),
    ("192.0.0.1", AddrClass.PROTOCOL_ASSIGNMENTS),
    ("192.0.0.9", AddrClass.PROTOCOL_ASSIGNMENTS),
    ("192.0.0.170", AddrClass.PROTOCOL_ASSIGNMENTS),
    ("2001:1::1", AddrClass.PROTOCOL_ASSIGNMENTS),
    ("2001:4:112::1", AddrClass.PROTOCOL_ASSIGNMENTS),
    ("100::1", AddrClass.DISCARD),
    ("2001:10::1", AddrClass.ORCHID),
    ("2001:20::1", AddrClass.ORCHID),
]


@pytest.mark.parametrize(("text", "expected"), CLASSES)
def test_classify(text: str, expected: AddrClass) -> None:
    verdict = classify(text)
    assert verdict.addr_class is expected, verdict
    assert verdict.embedded is None and verdict.via is None
    assert classify(ip_address(text.split("%")[0])).addr_class is expected


METADATA = [
    ("169.254.169.254", "aws"),
    ("169.254.169.254", "gcp"),
    ("169.254.169.254", "azure"),
    ("169.254.169.254", "oracle"),
    ("169.254.169.254", "openstack"),
    ("169.254.169.254", "digitalocean"),
    ("169.254.169.253", "aws"),
    ("169.254.169.123", "aws"),
    ("169.254.170.2", "aws-ecs"),
    ("169.254.170.23", "aws-eks"),
    ("100.100.100.200", "alibaba"),
    ("168.63.129.16", "azure"),
    ("169.254.0.23", "tencent"),
    ("192.0.0.192", "oracle"),
    ("169.254.42.42", "scaleway"),
    ("fd00:ec2::254", "aws"),
    ("fd00:ec2::253", "aws"),
    ("fd00:ec2::123", "aws"),
    ("fd00:ec2::23", "aws"),
    ("FD00:EC2:0::254", "aws"),
    ("fd20:ce::254", "gcp"),
    ("fd00:c1::a9fe:a9fe", "oracle"),
    ("fd00:42::42", "scaleway"),
    ("fe80::a9fe:a9fe", "openstack"),
    ("fe80::a9fe:a9fe%eth0", "openstack"),
]


@pytest.mark.parametrize(("text", "provider"), METADATA)
def test_metadata_before_other_classes(text: str, provider: str) -> None:
    verdict = classify(text)
    assert verdict.addr_class is AddrClass.METADATA
    assert verdict.provider is not None and provider in verdict.provider.split(",")
    assert verdict.reason is Reason.METADATA_ENDPOINT


# IPv4 embedded in IPv6: (address, class, embedded IPv4, via)
EMBEDDED = [
    # IPv4-mapped ::ffff:0:0/96
    ("::ffff:127.0.0.1", AddrClass.LOOPBACK, "127.0.0.1", "ipv4_mapped"),
    ("::ffff:7f00:1", AddrClass.LOOPBACK, "127.0.0.1", "ipv4_mapped"),
    ("::ffff:10.0.0.1", AddrClass.PRIVATE, "10.0.0.1", "ipv4_mapped"),
    ("::ffff:169.254.169.254", AddrClass.METADATA, "169.254.169.254", "ipv4_mapped"),
    ("::ffff:a9fe:a9fe", AddrClass.METADATA, "169.254.169.254", "ipv4_mapped"),
    ("::ffff:100.100.100.200", AddrClass.METADATA, "100.100.100.200", "ipv4_mapped"),
    ("::ffff:168.63.129.16", AddrClass.METADATA, "168.63.129.16", "ipv4_mapped"),
    ("::ffff:0.0.0.0", AddrClass.UNSPECIFIED, "0.0.0.0", "ipv4_mapped"),
    ("::ffff:100.64.0.1", AddrClass.CGNAT, "100.64.0.1", "ipv4_mapped"),
    ("::ffff:8.8.8.8", G, "8.8.8.8", "ipv4_mapped"),
    # IPv4-compatible ::/96 (deprecated): reserved even when the embedded address is global
    ("::127.0.0.1", AddrClass.LOOPBACK, "127.0.0.1", "ipv4_compatible"),
    ("::7f00:1", AddrClass.LOOPBACK, "127.0.0.1", "ipv4_compatible"),
    ("::a9fe:a9fe", AddrClass.METADATA, "169.254.169.254", "ipv4_compatible"),
    ("::2", AddrClass.THIS_NETWORK, "0.0.0.2", "ipv4_compatible"),
    ("::8.8.8.8", AddrClass.RESERVED, "8.8.8.8", "ipv4_compatible"),
    # IPv4-translated ::ffff:0:0:0/96
    ("::ffff:0:127.0.0.1", AddrClass.LOOPBACK, "127.0.0.1", "ipv4_translated"),
    ("::ffff:0:a9fe:a9fe", AddrClass.METADATA, "169.254.169.254", "ipv4_translated"),
    ("::ffff:0:8.8.8.8", AddrClass.RESERVED, "8.8.8.8", "ipv4_translated"),
    # NAT64 well-known prefix 64:ff9b::/96
    ("64:ff9b::127.0.0.1", AddrClass.LOOPBACK, "127.0.0.1", "nat64"),
    ("64:ff9b::a9fe:a9fe", AddrClass.METADATA, "169.254.169.254", "nat64"),
    ("64:ff9b::a00:1", AddrClass.PRIVATE, "10.0.0.1", "nat64"),
    ("64:ff9b::1", AddrClass.THIS_NETWORK, "0.0.0.1", "nat64"),
    ("64:ff9b::6440:1", AddrClass.CGNAT, "100.64.0.1", "nat64"),
    ("64:ff9b::808:808", G, "8.8.8.8", "nat64"),
    # NAT64 local-use 64:ff9b:1::/48: every RFC 6052 position is checked
    ("64:ff9b:1::a9fe:a9fe", AddrClass.METADATA, "169.254.169.254", "nat64_local/96"),
    # loopback at /48 but 0.0.0.0 at /96: the never-permitted candidate decides the class
    ("64:ff9b:1:7f00:0:100::", AddrClass.UNSPECIFIED, "0.0.0.0", "nat64_local/96"),
    ("64:ff9b:1:a9:fe:a9fe::", AddrClass.METADATA, "169.254.169.254", "nat64_local/56"),
    ("64:ff9b:1:808:ac:1000:108:808", AddrClass.PRIVATE, "172.16.0.1", "nat64_local/64"),
    ("64:ff9b:1::808:808", AddrClass.UNSPECIFIED, "0.0.0.0", "nat64_local/48"),  # fail closed
    ("64:ff9b:1:808:8:808:808:808", G, "8.8.8.8", "nat64_local/48"),
    # 6to4 2002::/16
    ("2002:7f00:1::1", AddrClass.LOOPBACK, "127.0.0.1", "6to4"),
    ("2002:a9fe:a9fe::", AddrClass.METADATA, "169.254.169.254", "6to4"),
    ("2002:c0a8:101::1", AddrClass.PRIVATE, "192.168.1.1", "6to4"),
    ("2002:808:808::1", G, "8.8.8.8", "6to4"),
    # Teredo 2001::/32: server field, and client = last 32 bits XOR 0xffffffff
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", AddrClass.DOCUMENTATION, "192.0.2.45", "teredo_client"),
    ("2001:0:808:808::80ff:fffe", AddrClass.LOOPBACK, "127.0.0.1", "teredo_client"),
    ("2001:0:808:808::5601:5601", AddrClass.METADATA, "169.254.169.254", "teredo_client"),
    ("2001:0:7f00:1::f7f7:f7f7", AddrClass.LOOPBACK, "127.0.0.1", "teredo_server"),
    ("2001:0:a9fe:a9fe::f7f7:f7f7", AddrClass.METADATA, "169.254.169.254", "teredo_server"),
    ("2001::1", AddrClass.UNSPECIFIED, "0.0.0.0", "teredo_server"),
    ("2001:0:808:808::f7f7:f7f7", G, "8.8.8.8", "teredo_server"),
]


@pytest.mark.parametrize(("text", "expected", "embedded", "via"), EMBEDDED)
def test_embedded_ipv4(text: str, expected: AddrClass, embedded: str, via: str) -> None:
    verdict = classify(text)
    assert verdict.addr_class is expected, verdict
    assert verdict.embedded == IPv4Address(embedded), verdict
    assert verdict.via == via
    assert isinstance(verdict.address, IPv6Address)
    if expected is not G:
        assert embedded in verdict.describe() and via in verdict.describe()


def test_teredo_checks_both_fields() -> None:
    # Global server, loopback client -> loopback; loopback server, global client -> loopback.
    assert classify("2001:0:808:808::80ff:fffe").addr_class is AddrClass.LOOPBACK
    assert classify("2001:0:7f00:1::f7f7:f7f7").addr_class is AddrClass.LOOPBACK


# ------------------------------------------------------------------------------- smokescreen cases

# smokescreen_test.go allowRanges ("10.0.0.1:321" is port-specific: a policy rule here, not a range).
SMOKESCREEN_ALLOW = tuple(
    ip_network(c) for c in ("8.8.9.0/24", "10.0.1.0/24", "172.16.1.0/24", "192.168.1.0/24", "127.0.1.0/24")
)

# TestClassifyAddr: (ip, permitted, class when denied)
SMOKESCREEN_CLASSIFY = [
    ("8.8.8.8", True, None),  # ipAllowDefault
    ("8.8.9.8", True, None),  # ipAllowUserConfigured
    ("10.0.0.1", False, AddrClass.PRIVATE),  # ipDenyPrivateRange
    ("10.0.1.1", True, None),
    ("172.16.0.1", False, AddrClass.PRIVATE),
    ("172.16.1.1", True, None),
    ("192.168.0.1", False, AddrClass.PRIVATE),
    ("192.168.1.1", True, None),
    ("127.0.0.1", False, AddrClass.LOOPBACK),  # ipDenyNotGlobalUnicast
    ("127.255.255.255", False, AddrClass.LOOPBACK),
    ("::1", False, AddrClass.LOOPBACK),
    ("127.0.1.1", True, None),  # allowed by 127.0.1.0/24
    ("169.254.169.254", False, AddrClass.METADATA),  # ec2 metadata endpoint
    ("255.255.255.255", False, AddrClass.BROADCAST),
    ("ff02:0:0:0:0:0:0:2", False, AddrClass.MULTICAST),
]


@pytest.mark.parametrize(("text", "permitted", "denied_as"), SMOKESCREEN_CLASSIFY)
def test_smokescreen_classify_addr(text: str, permitted: bool, denied_as: AddrClass | None) -> None:
    verdict = check_address(ip_address(text), SMOKESCREEN_ALLOW)
    if permitted:
        assert verdict is None
    else:
        assert verdict is not None and verdict.addr_class is denied_as


# TestUnsafeAllowPrivateRanges: every RFC 1918 range allowed; the rest stays denied.
RFC1918 = tuple(ip_network(c) for c in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))
SMOKESCREEN_UNSAFE_PRIVATE = [
    ("8.8.8.8", None),
    ("10.0.0.1", None),
    ("172.16.0.1", None),
    ("172.16.1.1", None),
    ("192.168.1.1", None),
    ("::ffff:10.0.0.1", None),
    ("127.0.0.1", AddrClass.LOOPBACK),
    ("127.255.255.255", AddrClass.LOOPBACK),
    ("::1", AddrClass.LOOPBACK),
    ("169.254.169.254", AddrClass.METADATA),
    ("255.255.255.255", AddrClass.BROADCAST),
    ("ff02:0:0:0:0:0:0:2", AddrClass.MULTICAST),
    ("100.64.0.1", AddrClass.CGNAT),
]


@pytest.mark.parametrize(("text", "denied_as"), SMOKESCREEN_UNSAFE_PRIVATE)
def test_smokescreen_unsafe_allow_private_ranges(text: str, denied_as: AddrClass | None) -> None:
    verdict = check_address(text, RFC1918)
    assert (verdict.addr_class if verdict else None) is denied_as


# TestMostSpecificIPPolicySafetyChecks + TestIPFilterBypassPolicy addresses: denied by default...
SMOKESCREEN_SAFETY = [
    ("10.0.0.1", AddrClass.PRIVATE),
    ("127.0.0.1", AddrClass.LOOPBACK),
    ("100.64.0.1", AddrClass.CGNAT),
    ("64:ff9b::1", AddrClass.THIS_NETWORK),
    ("64:ff9b::a00:1", AddrClass.PRIVATE),
    ("fc00::1", AddrClass.ULA),
    ("169.254.169.254", AddrClass.METADATA),
    ("8.8.8.8", None),
]


@pytest.mark.parametrize(("text", "denied_as"), SMOKESCREEN_SAFETY)
def test_smokescreen_safety_checks(text: str, denied_as: AddrClass | None) -> None:
    verdict = check_address(text, ())
    assert (verdict.addr_class if verdict else None) is denied_as
    # ...and opened by an explicit allow_private entry for exactly that address -- except metadata.
    target = verdict.embedded if verdict and verdict.embedded else ip_address(text)
    opened = check_address(text, (ip_network(target),))
    if denied_as is AddrClass.METADATA:
        assert opened is not None and opened.addr_class is AddrClass.METADATA
    else:
        assert opened is None


def test_smokescreen_mapped_tie() -> None:
    # mostSpecificIPPolicy "mapped" rows: an IPv4 allow covers the mapped form and vice versa.
    assert check_address("::ffff:10.0.0.5", (ip_network("10.0.0.5/32"),)) is None
    assert check_address("10.0.0.5", (ip_network("10.0.0.5/32"),)) is None
    assert check_address("fd00::5", (ip_network("fd00::/64"),)) is None


# ------------------------------------------------------------------------------- check_address rules

EVERYTHING = (ip_network("0.0.0.0/0"), ip_network("::/0"))


@pytest.mark.parametrize("text", [*sorted({t for t, _ in METADATA}), "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe"])
def test_metadata_is_never_permitted(text: str) -> None:
    for allow in ((), EVERYTHING, (ip_network("169.254.0.0/16"),), (ip_network("fd00::/8"),)):
        verdict = check_address(text, allow)
        assert verdict is not None and verdict.addr_class is AddrClass.METADATA


@pytest.mark.parametrize("text", ["0.0.0.0", "::", "::ffff:0.0.0.0"])
def test_unspecified_is_never_permitted(text: str) -> None:
    verdict = check_address(text, EVERYTHING)
    assert verdict is not None and verdict.addr_class is AddrClass.UNSPECIFIED


def test_embedded_forms_need_the_embedded_ipv4_covered() -> None:
    # An IPv6 allow around the translator prefix does not open the IPv4 hosts behind it.
    assert check_address("64:ff9b::7f00:1", (ip_network("64:ff9b::/96"),)) is not None
    assert check_address("2002:7f00:1::1", (ip_network("2002::/16"),)) is not None
    assert check_address("::ffff:10.0.0.1", (ip_network("::ffff:0:0/96"),)) is not None
    assert check_address("64:ff9b::a00:1", (ip_network("10.0.0.0/8"),)) is None
    assert check_address("64:ff9b::a00:1", (ip_network("10.0.1.0/24"),)) is not None


def test_allow_private_is_exact() -> None:
    allow = (ip_network("10.1.0.0/16"),)
    assert check_address("10.1.255.255", allow) is None
    assert check_address("10.2.0.0", allow) is not None
    assert check_address("172.16.0.1", allow) is not None
    assert check_address("fd00::1", allow) is not None  # version mismatch never covers


def test_global_is_permitted_without_allow_private() -> None:
    assert check_address("8.8.8.8") is None
    assert check_address(ip_address("2606:4700:4700::1111"), ()) is None


def test_classify_rejects_non_addresses() -> None:
    for bad in ("example.com", "127.1", "", "1.2.3.4/32", 5, None):
        with pytest.raises(CanonError) as info:
            classify(bad)  # type: ignore[arg-type]
        assert info.value.code == "bad_ip"


def test_classification_helpers() -> None:
    v = classify("::ffff:127.0.0.1")
    assert isinstance(v, Classification)
    assert not v.is_global and v.reason is Reason.ADDRESS_FORBIDDEN
    assert classify("8.8.8.8").is_global
    assert {AddrClass.METADATA, AddrClass.UNSPECIFIED} == NEVER_PERMITTED
    assert all(net.prefixlen in (32, 128) or net == ip_network("fd00:ec2::/32") for net in METADATA_ADDRESSES)


# ------------------------------------------------------------------------------- metadata names

METADATA_NAMES = [
    "metadata.google.internal",
    "METADATA.GOOGLE.INTERNAL.",
    "metadata\u3002google\u3002internal",
    "metadata.goog",
    "metadata",
    "instance-data",
    "instance-data.ec2.internal",
    "metadata.tencentyun.com",
]


@pytest.mark.parametrize("raw", METADATA_NAMES)
def test_metadata_hostnames_after_canonicalization(raw: str) -> None:
    assert is_metadata_hostname(canon_host(raw))
    assert canon_host(raw) in METADATA_HOSTNAMES


def test_metadata_hostnames_are_canonical() -> None:
    for name in METADATA_HOSTNAMES:
        assert canon_host(name) == name


def test_ip_literal_spellings_of_metadata_are_metadata() -> None:
    spellings = [
        "169.254.169.254",
        "2852039166",
        "0xa9fea9fe",
        "0251.0376.0251.0376",
        "169.254.43518",
        "[::ffff:a9fe:a9fe]",
        "[64:ff9b::a9fe:a9fe]",
        "\uff11\uff16\uff19\u3002254\u3002169\u3002254",
    ]
    for raw in spellings:
        ip = parse_ip_literal(raw)
        assert ip is not None
        assert classify(ip).addr_class is AddrClass.METADATA, raw


# ------------------------------------------------------------------------------- properties

_V4 = st.integers(0, 2**32 - 1).map(IPv4Address)
_V6 = st.integers(0, 2**128 - 1).map(IPv6Address)
# Addresses near the interesting prefixes, so embedded forms are exercised, not just random space.
# (prefix, mask of the bits that vary)
_PREFIXES = [
    (0, 2**32 - 1),
    (0xFFFF << 32, 2**32 - 1),
    (0xFFFF << 64, 2**32 - 1),
    (0x64FF9B << 96, 2**32 - 1),
    (0x64FF9B0001 << 80, 2**80 - 1),
    (0x2002 << 112, 2**112 - 1),
    (0x20010000 << 96, 2**96 - 1),
]
_V6_EMBEDDED = st.tuples(st.sampled_from(_PREFIXES), st.integers(0, 2**128 - 1)).map(
    lambda t: IPv6Address(t[0][0] | (t[1] & t[0][1]))
)
_V4_INTERESTING = st.sampled_from(
    [IPv4Address(n) for n in (0, 1, 0x7F000001, 0x0A000001, 0xA9FEA9FE, 0x646464C8, 0x08080808)]
)


@settings(max_examples=600, deadline=None)
@given(st.one_of(_V4, _V6, _V6_EMBEDDED))
def test_classify_total_and_consistent(ip: IPv4Address | IPv6Address) -> None:
    verdict = classify(ip)
    assert isinstance(verdict.addr_class, AddrClass)
    assert classify(str(ip)) == verdict
    # Opening everything still never permits metadata / unspecified; permits all else.
    opened = check_address(ip, EVERYTHING)
    assert (opened is None) == (verdict.addr_class not in NEVER_PERMITTED)
    if verdict.is_global and verdict.embedded is None:
        # We are stricter than Python's registry copy, never looser.
        assert ip.is_global, ip
    if verdict.via is not None:
        assert verdict.embedded is not None


@settings(max_examples=300, deadline=None)
@given(st.one_of(_V4, _V4_INTERESTING))
def test_mapped_nat64_6to4_follow_the_embedded_ipv4(v4: IPv4Address) -> None:
    inner = classify(v4).addr_class
    n = int(v4)
    forms = [
        IPv6Address((0xFFFF << 32) | n),
        IPv6Address((0x64FF9B << 96) | n),
        IPv6Address((0x2002 << 112) | (n << 80) | 1),
    ]
    for form in forms:
        verdict = classify(form)
        assert verdict.embedded == v4
        assert verdict.addr_class is inner, (form, verdict)
