"""Settings of the DNS resolver.

A plain dataclass (not the gateway's pydantic config) so `egressgate run` can build it from whatever its own
config model says and tests can build it inline. Every limit has a default that is safe for a single gateway;
`validate()` rejects nonsense early because a resolver misconfigured into "no timeout" or "no connection cap"
is a denial-of-service waiting to happen.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

RESOLV_CONF = Path("/etc/resolv.conf")
DENY_RCODES = ("NXDOMAIN", "REFUSED")


class DnsConfigError(ValueError):
    """A DNS setting is invalid; the message names the field."""


def parse_resolv_conf(text: str) -> tuple[tuple[str, int], ...]:
    """`nameserver` lines of a resolv.conf, as (address, 53) pairs, in file order.

    Only literal IP addresses are accepted (resolv.conf allows nothing else); a scoped IPv6 address keeps its
    zone. Why parse it ourselves: the stdlib has no resolv.conf reader and dnspython's would pull its
    resolver configuration semantics (search lists, options) we do not want to forward.
    """
    servers: list[tuple[str, int]] = []
    for line in text.splitlines():
        parts = line.split("#", 1)[0].split(";", 1)[0].split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            address = parts[1]
            try:
                ipaddress.ip_address(address.split("%", 1)[0])
            except ValueError:
                continue
            servers.append((address, 53))
    return tuple(servers)


def system_upstreams(path: Path = RESOLV_CONF) -> tuple[tuple[str, int], ...]:
    """The machine's resolvers; empty when the file is missing (then every allowed query gets SERVFAIL)."""
    try:
        return parse_resolv_conf(path.read_text())
    except OSError:
        return ()


@dataclass(frozen=True, slots=True)
class DnsConfig:
    # Upstream resolvers, tried in order; None means "the nameservers of /etc/resolv.conf" (read when the
    # resolver is built; a nameserver equal to our own listener is refused at start()).
    upstreams: tuple[tuple[str, int], ...] | None = None
    upstream_timeout: float = 2.0  # seconds per upstream attempt (UDP, and again for a TCP retry)
    upstream_edns_size: int = 1232  # EDNS payload size we advertise upstream (DNS flag day 2020 value)
    max_udp_response: int = 1232  # cap on the EDNS size we honour from clients
    # Cache
    cache_size: int = 10_000  # entries keyed by (name, qtype)
    cache_min_ttl: int = 5  # seconds; floors tiny upstream TTLs so a loop of queries hits the cache
    cache_max_ttl: int = 3600  # seconds; also the ceiling on TTLs we hand to clients
    negative_ttl: int = 60  # NXDOMAIN/NODATA lifetime when the upstream sent no SOA; SOA minimum otherwise
    # TCP
    tcp_idle_timeout: float = 10.0  # seconds without a complete new message before we close
    tcp_max_connections: int = 256  # accepted connections beyond this are closed at once
    tcp_max_inflight: int = 32  # pipelined queries processed at once per connection
    tcp_max_per_client: int = 32  # connections per source address (one sandbox cannot take every slot)
    # UDP
    udp_max_inflight: int = 2048  # queries being processed at once; more are dropped and counted
    udp_max_inflight_per_client: int = 256  # the same, per source address
    max_query_size: int = 1024  # bytes; a larger query is dropped (a real one is < 300 bytes)
    # Who may ask
    unknown_client_policy: str | None = None  # policy name for unregistered sources; None = deny everything
    deny_rcode: str = "REFUSED"  # answer to unknown clients and when no policy applies
    unknown_client_table: int = 4096  # how many unknown sources we keep budgets/rate state for
    # Where a policy's `deny_answer: gateway` points denied names (gateway_answer.py): "auto" (the host end of
    # the asker's /30), an IPv4 address, or None: no gateway answers (the policy's deny rcode). `egressgate
    # run` passes "auto" only when it runs a transparent listener (the address must reach one).
    gateway_answer: str | None = None
    gateway_answer_networks: tuple[str, ...] = ()  # "auto" only for clients in these networks (empty: any)

    def validate(self) -> DnsConfig:
        """Return self, or raise DnsConfigError naming the first bad field."""
        if self.deny_rcode not in DENY_RCODES:
            raise DnsConfigError(f"deny_rcode must be one of {DENY_RCODES}, not {self.deny_rcode!r}")
        if self.gateway_answer not in (None, "auto"):
            try:
                ipaddress.IPv4Address(self.gateway_answer)
            except ValueError as exc:
                raise DnsConfigError(f"gateway_answer must be 'auto' or an IPv4 address, not "
                                     f"{self.gateway_answer!r}") from exc
        positive = {
            "upstream_timeout": self.upstream_timeout,
            "tcp_idle_timeout": self.tcp_idle_timeout,
            "tcp_max_connections": self.tcp_max_connections,
            "tcp_max_inflight": self.tcp_max_inflight,
            "udp_max_inflight": self.udp_max_inflight,
            "udp_max_inflight_per_client": self.udp_max_inflight_per_client,
            "tcp_max_per_client": self.tcp_max_per_client,
            "cache_max_ttl": self.cache_max_ttl,
            "unknown_client_table": self.unknown_client_table,
        }
        for name, value in positive.items():
            if not value > 0:
                raise DnsConfigError(f"{name} must be > 0, not {value!r}")
        for name, value in {
            "cache_size": self.cache_size,
            "cache_min_ttl": self.cache_min_ttl,
            "negative_ttl": self.negative_ttl,
        }.items():
            if value < 0:
                raise DnsConfigError(f"{name} must be >= 0, not {value!r}")
        if self.cache_min_ttl > self.cache_max_ttl:
            raise DnsConfigError("cache_min_ttl must not exceed cache_max_ttl")
        if not 512 <= self.max_udp_response <= 65535 or not 512 <= self.upstream_edns_size <= 65535:
            raise DnsConfigError("max_udp_response and upstream_edns_size must be within 512..65535")
        if not 12 <= self.max_query_size <= 65535:
            raise DnsConfigError("max_query_size must be within 12..65535")
        for host, port in self.upstreams or ():
            try:
                ipaddress.ip_address(host.split("%", 1)[0])
            except ValueError as exc:
                raise DnsConfigError(f"upstream {host!r} is not an IP address") from exc
            if not 0 < port < 65536:
                raise DnsConfigError(f"upstream port {port!r} out of range")
        return self

    def resolved_upstreams(self) -> tuple[tuple[str, int], ...]:
        return self.upstreams if self.upstreams is not None else system_upstreams()
