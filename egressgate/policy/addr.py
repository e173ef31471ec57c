"""Address classes: which destinations the gateway may dial at all, whatever the rules say.

The gateway resolves a name itself, classifies every address, and dials only a checked one, so this
module is the last line against SSRF: loopback, RFC 1918, CGNAT, link-local, cloud metadata, ULA and
friends are refused unless the policy's ``allow_private`` covers them, and metadata is refused always.

Order of classification (first match wins):

1. **Metadata** -- exact cloud metadata / platform-service addresses (:data:`METADATA_ADDRESSES`), checked
   before link-local so ``169.254.169.254`` reports ``metadata`` with its provider, and including public
   or ULA ones a "deny private ranges" rule misses (Azure WireServer ``168.63.129.16``, Alibaba
   ``100.100.100.200``, AWS ``fd00:ec2::/32``, GCP ``fd20:ce::254``, Oracle ``fd00:c1::a9fe:a9fe``).
2. **IPv4 embedded in IPv6** -- the embedded IPv4 address(es) are classified (metadata included); if
   ANY is not global, the whole address takes that class, with ``embedded`` and ``via`` naming it:

   ========================  ===================  =================================================
   form                      ``via``              embedded IPv4
   ========================  ===================  =================================================
   ``::ffff:0:0/96``          ``ipv4_mapped``      last 32 bits (a dual-stack socket dials it)
   ``::ffff:0:0:0/96``        ``ipv4_translated``  last 32 bits (SIIT, RFC 2765)
   ``::/96`` (not ``::``,     ``ipv4_compatible``  last 32 bits (deprecated, RFC 4291 2.5.5.1)
   ``::1``)
   ``64:ff9b::/96``           ``nat64``            last 32 bits (RFC 6052 well-known prefix)
   ``64:ff9b:1::/48``         ``nat64_local/N``    every RFC 6052 position for N = 48, 56, 64, 96
   ``2002::/16``              ``6to4``             bits 16..47
   ``2001::/32``              ``teredo_server``,   server: bits 32..63; client: last 32 bits XOR
                              ``teredo_client``    ``0xffffffff``
   ========================  ===================  =================================================

   RFC 8215's local-use prefix may be split by the operator into /48../96 translator prefixes, and the
   prefix length cannot be read from an address. Rather than guess, every position RFC 6052 defines for
   a prefix length >= 48 is decoded and all must be global (fail closed). In practice this refuses
   most local-use NAT64 addresses (an unused position decodes to ``0.0.0.0``); use ``64:ff9b::/96``.
   When all embedded addresses are global: mapped, NAT64, 6to4 and Teredo addresses are ``global`` (the
   packet ends up at that global IPv4 host); compatible and translated forms are ``reserved`` (no
   legitimate egress use, nothing routes them on the Internet).
3. **Special-purpose ranges** (IANA IPv4/IPv6 special-purpose registries), most specific first; every
   IPv6 address outside ``2000::/3`` and the listed ranges is ``reserved``.

:func:`check_address` applies the policy: ``metadata`` and ``unspecified`` are never permitted (even if
an ``allow_private`` CIDR covers them: ``0.0.0.0`` / ``::`` mean "this host" to ``connect()``); ``global``
is permitted; everything else is permitted only if an ``allow_private`` network contains it -- for an
embedded form, the *embedded IPv4* must be covered (an IPv6 CIDR around ``64:ff9b::/96`` does not open
every IPv4 host behind the translator). Forms with more than one embedded IPv4 (Teredo server and
client, the RFC 6052 positions of ``64:ff9b:1::/48``) need EVERY non-global one covered: the packet may
reach either (a Teredo relay talks to the server, the peer is the client; the translator's prefix length
decides which position is dialled), so opening one must not open the others.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network

from egressgate.policy.canon import CanonError
from egressgate.policy.reasons import Reason

__all__ = [
    "METADATA_ADDRESSES",
    "METADATA_HOSTNAMES",
    "NEVER_PERMITTED",
    "AddrClass",
    "Classification",
    "check_address",
    "classify",
    "is_metadata_hostname",
]

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network


class AddrClass(StrEnum):
    GLOBAL = "global"
    LOOPBACK = "loopback"  # 127/8, ::1
    UNSPECIFIED = "unspecified"  # 0.0.0.0, ::
    THIS_NETWORK = "this_network"  # 0/8 except 0.0.0.0 (RFC 791/1122)
    PRIVATE = "private"  # RFC 1918
    CGNAT = "cgnat"  # 100.64/10, RFC 6598
    LINK_LOCAL = "link_local"  # 169.254/16, fe80::/10
    METADATA = "metadata"  # cloud metadata / platform services, see METADATA_ADDRESSES
    ULA = "ula"  # fc00::/7, RFC 4193
    SITE_LOCAL = "site_local"  # fec0::/10, deprecated by RFC 3879
    MULTICAST = "multicast"  # 224/4, ff00::/8
    BROADCAST = "broadcast"  # 255.255.255.255
    RESERVED = "reserved"  # 240/4, 192.88.99/24, 5f00::/16, IPv6 outside 2000::/3, deprecated embeddings
    BENCHMARK = "benchmark"  # 198.18/15, 2001:2::/48
    DOCUMENTATION = "documentation"  # TEST-NET-1/2/3, 2001:db8::/32, 3fff::/20
    PROTOCOL_ASSIGNMENTS = "protocol_assignments"  # 192.0.0/24, 2001::/23 (rest)
    DISCARD = "discard"  # 100::/64, RFC 6666
    ORCHID = "orchid"  # 2001:10::/28, 2001:20::/28 (RFC 4843, RFC 7343)


NEVER_PERMITTED = frozenset({AddrClass.METADATA, AddrClass.UNSPECIFIED})
"""Classes no ``allow_private`` entry can open."""


@dataclass(frozen=True, slots=True)
class Classification:
    """Why an address is (not) dialable. ``address`` is the address classified (scope id dropped);
    ``embedded``/``via`` name the IPv4 address and the IPv6 form that decided the class;
    ``provider`` names the cloud(s) for metadata addresses."""

    addr_class: AddrClass
    address: IPAddress
    embedded: IPv4Address | None = None
    via: str | None = None
    provider: str | None = None
    others: tuple[Classification, ...] = ()  # further non-global embedded IPv4s (Teredo, NAT64 local)

    @property
    def is_global(self) -> bool:
        return self.addr_class is AddrClass.GLOBAL

    @property
    def reason(self) -> Reason:
        """The deny reason code for this class (meaningless for global addresses)."""
        return Reason.METADATA_ENDPOINT if self.addr_class is AddrClass.METADATA else Reason.ADDRESS_FORBIDDEN

    def describe(self) -> str:
        """One human phrase, e.g. ``127.0.0.1 (loopback, embedded via ipv4_mapped in ::ffff:7f00:1)``."""
        subject = self.embedded if self.embedded is not None else self.address
        text = f"{subject} ({self.addr_class}"
        if self.provider:
            text += f", {self.provider}"
        if self.via:
            text += f", embedded via {self.via} in {self.address}"
        return text + ")"


# ------------------------------------------------------------------------------------------- metadata

_AWS = "aws"
_IMDS_169 = "aws,gcp,azure,oracle,openstack,digitalocean,hetzner,linode,ibm,huawei"
METADATA_ADDRESSES: dict[IPNetwork, str] = {
    ip_network("169.254.169.254/32"): _IMDS_169,  # the common IMDS address
    ip_network("169.254.169.253/32"): _AWS,  # Amazon DNS (Route 53 Resolver)
    ip_network("169.254.169.123/32"): _AWS,  # Amazon Time Sync
    ip_network("169.254.170.2/32"): "aws-ecs",  # ECS task metadata / container credentials
    ip_network("169.254.170.23/32"): "aws-eks",  # EKS Pod Identity Agent
    ip_network("100.100.100.200/32"): "alibaba",  # inside CGNAT space
    ip_network("168.63.129.16/32"): "azure",  # WireServer: a *public* address
    ip_network("169.254.0.23/32"): "tencent",
    ip_network("192.0.0.192/32"): "oracle",  # OCI Classic
    ip_network("169.254.42.42/32"): "scaleway",
    ip_network("fd00:ec2::/32"): _AWS,  # IMDS ::254, DNS ::253, NTP ::123, EKS Pod Identity ::23
    ip_network("fd20:ce::254/128"): "gcp",
    ip_network("fd00:c1::a9fe:a9fe/128"): "oracle",
    ip_network("fd00:42::42/128"): "scaleway",
    ip_network("fe80::a9fe:a9fe/128"): "openstack",
}
"""Cloud metadata / platform-service addresses, value = provider(s). Checked before every other class."""

METADATA_HOSTNAMES: frozenset[str] = frozenset(
    {
        "metadata.google.internal",  # GCP
        "metadata.goog",  # GCP
        "metadata",  # GCP short name (search domain)
        "instance-data",  # AWS (search domain ec2.internal)
        "instance-data.ec2.internal",  # AWS
        "metadata.tencentyun.com",  # Tencent Cloud
        "metadata.platformequinix.com",  # Equinix Metal
        "metadata.packet.net",  # Equinix Metal (Packet) legacy
        "rancher-metadata",  # Rancher
    }
)
"""Canonical names (canon_host output) that are denied as metadata_endpoint before any resolution.
Azure and Alibaba publish no metadata host name (IP only); their addresses are in METADATA_ADDRESSES."""


def is_metadata_hostname(canonical_host: str) -> bool:
    """Whether a canonical host is a metadata name (exact match; callers canonicalize first)."""
    return canonical_host in METADATA_HOSTNAMES


# ------------------------------------------------------------------------------------------- tables


def _table(entries: list[tuple[str, AddrClass]]) -> tuple[tuple[int, int, AddrClass], ...]:
    rows = []
    for cidr, cls in entries:
        net = ip_network(cidr)
        rows.append((int(net.network_address), int(net.netmask), cls))
    return tuple(rows)


def _metadata_table(version: int) -> tuple[tuple[int, int, str], ...]:
    return tuple(
        (int(net.network_address), int(net.netmask), provider)
        for net, provider in METADATA_ADDRESSES.items()
        if net.version == version
    )


_V4_META = _metadata_table(4)
_V6_META = _metadata_table(6)

_V4 = _table(
    [
        ("0.0.0.0/32", AddrClass.UNSPECIFIED),
        ("0.0.0.0/8", AddrClass.THIS_NETWORK),
        ("10.0.0.0/8", AddrClass.PRIVATE),
        ("100.64.0.0/10", AddrClass.CGNAT),
        ("127.0.0.0/8", AddrClass.LOOPBACK),
        ("169.254.0.0/16", AddrClass.LINK_LOCAL),
        ("172.16.0.0/12", AddrClass.PRIVATE),
        ("192.0.0.0/24", AddrClass.PROTOCOL_ASSIGNMENTS),
        ("192.0.2.0/24", AddrClass.DOCUMENTATION),
        ("192.88.99.0/24", AddrClass.RESERVED),  # deprecated 6to4 relay anycast (RFC 7526)
        ("192.168.0.0/16", AddrClass.PRIVATE),
        ("198.18.0.0/15", AddrClass.BENCHMARK),
        ("198.51.100.0/24", AddrClass.DOCUMENTATION),
        ("203.0.113.0/24", AddrClass.DOCUMENTATION),
        ("224.0.0.0/4", AddrClass.MULTICAST),
        ("255.255.255.255/32", AddrClass.BROADCAST),
        ("240.0.0.0/4", AddrClass.RESERVED),
    ]
)

_V6 = _table(
    [
        ("::/128", AddrClass.UNSPECIFIED),
        ("::1/128", AddrClass.LOOPBACK),
        ("100::/64", AddrClass.DISCARD),
        ("2001:2::/48", AddrClass.BENCHMARK),
        ("2001:db8::/32", AddrClass.DOCUMENTATION),
        ("2001:10::/28", AddrClass.ORCHID),
        ("2001:20::/28", AddrClass.ORCHID),
        ("2001::/23", AddrClass.PROTOCOL_ASSIGNMENTS),
        ("3fff::/20", AddrClass.DOCUMENTATION),
        ("5f00::/16", AddrClass.RESERVED),  # SRv6 SIDs (RFC 9602), not globally reachable
        ("2000::/3", AddrClass.GLOBAL),
        ("fc00::/7", AddrClass.ULA),
        ("fe80::/10", AddrClass.LINK_LOCAL),
        ("fec0::/10", AddrClass.SITE_LOCAL),
        ("ff00::/8", AddrClass.MULTICAST),
    ]
)

_MASK32 = 0xFFFFFFFF


def _lookup(value: int, table: tuple[tuple[int, int, AddrClass], ...], default: AddrClass) -> AddrClass:
    for net, mask, cls in table:
        if value & mask == net:
            return cls
    return default


def _metadata_provider(value: int, table: tuple[tuple[int, int, str], ...]) -> str | None:
    for net, mask, provider in table:
        if value & mask == net:
            return provider
    return None


def _classify_v4(ip: IPv4Address) -> tuple[AddrClass, str | None]:
    value = int(ip)
    provider = _metadata_provider(value, _V4_META)
    if provider is not None:
        return AddrClass.METADATA, provider
    return _lookup(value, _V4, AddrClass.GLOBAL), None


def _rfc6052(value: int, prefix_len: int) -> IPv4Address:
    """The IPv4 address at the RFC 6052 position for ``prefix_len`` (skipping the u octet, bits 64-71)."""
    b = value.to_bytes(16, "big")
    octets = {
        48: (b[6], b[7], b[9], b[10]),
        56: (b[7], b[9], b[10], b[11]),
        64: (b[9], b[10], b[11], b[12]),
        96: (b[12], b[13], b[14], b[15]),
    }[prefix_len]
    return IPv4Address(bytes(octets))


def _embedded(value: int) -> tuple[list[tuple[str, IPv4Address]], AddrClass] | None:
    """(embedded IPv4 candidates with their form, class when all are global) or None."""
    high96 = value >> 32
    low = IPv4Address(value & _MASK32)
    if high96 == 0xFFFF:
        return [("ipv4_mapped", low)], AddrClass.GLOBAL
    if high96 == 0xFFFF_0000:
        return [("ipv4_translated", low)], AddrClass.RESERVED
    if high96 == 0 and value > 1:
        return [("ipv4_compatible", low)], AddrClass.RESERVED
    if high96 == 0x0064_FF9B_0000_0000_0000_0000:
        return [("nat64", low)], AddrClass.GLOBAL
    if value >> 80 == 0x0064_FF9B_0001:
        return [(f"nat64_local/{n}", _rfc6052(value, n)) for n in (48, 56, 64, 96)], AddrClass.GLOBAL
    if value >> 112 == 0x2002:
        return [("6to4", IPv4Address((value >> 80) & _MASK32))], AddrClass.GLOBAL
    if value >> 96 == 0x2001_0000:
        server = IPv4Address((value >> 64) & _MASK32)
        client = IPv4Address((value & _MASK32) ^ _MASK32)
        return [("teredo_server", server), ("teredo_client", client)], AddrClass.GLOBAL
    return None


def _severity(verdict: tuple[str, IPv4Address, AddrClass, str | None]) -> int:
    cls = verdict[2]
    return 0 if cls is AddrClass.METADATA else 1 if cls in NEVER_PERMITTED else 2


def _classify_v6(ip: IPv6Address) -> Classification:
    value = int(ip)
    provider = _metadata_provider(value, _V6_META)
    if provider is not None:
        return Classification(AddrClass.METADATA, ip, provider=provider)
    found = _embedded(value)
    if found is not None:
        candidates, when_global = found
        verdicts = [(via, v4, *_classify_v4(v4)) for via, v4 in candidates]
        # Every non-global candidate is kept: the most severe decides the class (metadata, then the
        # never-permitted unspecified, then position order) and the rest ride along in `others`, so
        # check_address can demand that EACH is covered by allow_private, not just the first.
        bad = sorted((v for v in verdicts if v[2] is not AddrClass.GLOBAL), key=_severity)
        if bad:
            found = [Classification(cls, ip, embedded=v4, via=via, provider=prov) for via, v4, cls, prov in bad]
            return replace(found[0], others=tuple(found[1:]))
        via, v4 = candidates[0]
        return Classification(when_global, ip, embedded=v4, via=via)
    return Classification(_lookup(value, _V6, AddrClass.RESERVED), ip)


def _address(ip: object) -> IPAddress:
    if isinstance(ip, IPv4Address):
        return ip
    if isinstance(ip, IPv6Address):
        return IPv6Address(int(ip)) if ip.scope_id else ip
    if isinstance(ip, str):
        try:
            parsed = ip_address(ip)
        except ValueError:
            raise CanonError("bad_ip", f"not an IP address: {ip[:60]!r}") from None
        return _address(parsed)
    raise CanonError("bad_ip", f"not an IP address: {type(ip).__name__}")


def classify(ip: IPAddress | str) -> Classification:
    """Classify one address (an ``ipaddress`` object or its strict text; scope ids are ignored)."""
    return _classify(_address(ip))


@functools.lru_cache(maxsize=8192)
def _classify(address: IPAddress) -> Classification:
    # Cached: the same few upstream addresses are checked on every request; results are immutable.
    if isinstance(address, IPv4Address):
        cls, provider = _classify_v4(address)
        return Classification(cls, address, provider=provider)
    return _classify_v6(address)


def check_address(ip: IPAddress | str, allow_private: Iterable[IPNetwork] = ()) -> Classification | None:
    """None when the gateway may dial ``ip``; otherwise the classification that forbids it."""
    verdict = classify(ip)
    if verdict.addr_class is AddrClass.GLOBAL:
        return None
    networks = tuple(allow_private)
    for part in (verdict, *verdict.others):  # every non-global embedded IPv4 must pass, not the first
        if part.addr_class in NEVER_PERMITTED or not _covered(part, networks):
            return part
    return None


def _covered(verdict: Classification, networks: tuple[IPNetwork, ...]) -> bool:
    target = verdict.embedded if verdict.embedded is not None else verdict.address
    return any(network.version == target.version and target in network for network in networks)
