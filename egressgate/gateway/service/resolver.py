"""Upstream name resolution for the gateway: the system resolver, or DNS servers through dns/upstream.py.

The gateway resolves every destination itself (once), checks every address, then dials exactly the
checked one; mitmproxy never resolves. Two lookups sit behind one `GatewayResolver`:

* "system": getaddrinfo in the loop's executor (it blocks). It reports no TTL, so answers are reused for
  SYSTEM_CACHE_SECONDS.
* "host:port": the DNS client the resolver uses (dns/upstream.py: fresh source port and random id per
  query, replies accepted only when source, id and question match, TCP retry on a truncated UDP reply).
  Only address records on the CNAME chain of the asked name count (dns/filter.py's `cname_chain`, the
  resolver's rule): a record for another owner in the answer section is an injection, not an address.
  Answers are reused for their smallest TTL, capped at DNS_CACHE_MAX_SECONDS (TTL 0 = not reused).

Why a cache at all: resolution sits on every plain-HTTP request's path (absolute-form requests are
decided one by one), and a thread hop or a DNS round trip per request cost ~7 % of the gateway's CPU
under load. It cannot weaken pinning: every address, cached or not, is classified with the asking
sandbox's policy before it is dialed, and the checked address is the one dialed. Failures are never
cached (a transient upstream problem must not pin a denial), and concurrent lookups of one name share a
single query. Failures raise ResolveError: the caller denies (`upstream_unresolvable`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable
from typing import Protocol

from dnslib import DNSLabel

from egressgate.config import parse_listen
from egressgate.dns.filter import T_A, T_AAAA, T_CNAME, cname_chain, name_key, record_address
from egressgate.dns.metrics import DnsMetrics
from egressgate.dns.upstream import Upstream, UpstreamAnswer, UpstreamFailed
from egressgate.dns.wire import MAX_LABEL, MAX_NAME_WIRE, NXDOMAIN
from egressgate.policy.facts import IPAddress

MAX_ANSWERS = 32
SYSTEM_CACHE_SECONDS = 2.0
DNS_CACHE_MAX_SECONDS = 300.0  # upper bound on reusing a DNS answer, whatever TTL it carries
DNS_TIMEOUT_MAX = 5.0  # seconds per DNS attempt (UDP, and again for a TCP retry)
EDNS_SIZE = 1232  # what we advertise upstream (the resolver's default, DNS flag day 2020)


class ResolveError(RuntimeError):
    """The name could not be resolved (NXDOMAIN, timeout, no usable address)."""


class Resolver(Protocol):
    async def resolve(self, host: str) -> tuple[IPAddress, ...]: ...


class Lookup(Protocol):
    async def __call__(self, host: str) -> tuple[tuple[IPAddress, ...], float]:
        """(addresses, seconds they may be reused); raises ResolveError."""
        ...


class SystemLookup:
    """getaddrinfo; reports no TTL, so every answer gets SYSTEM_CACHE_SECONDS."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    async def __call__(self, host: str) -> tuple[tuple[IPAddress, ...], float]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), self.timeout
            )
        except (OSError, TimeoutError) as exc:
            raise ResolveError(f"cannot resolve {host}: {exc}") from exc
        out: list[IPAddress] = []
        for _family, _type, _proto, _canon, sockaddr in infos:
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if ip not in out:
                out.append(ip)
        if not out:
            raise ResolveError(f"no addresses for {host}")
        return tuple(out[:MAX_ANSWERS]), SYSTEM_CACHE_SECONDS


def chain_addresses(host: str, qtype: int, answer: UpstreamAnswer) -> tuple[list[IPAddress], float]:
    """Addresses of type `qtype` on the CNAME chain of `host`, and the smallest TTL of the records used.
    An NXDOMAIN has no addresses, whatever records came with it (the name does not exist)."""
    if answer.rcode == NXDOMAIN:
        return [], DNS_CACHE_MAX_SECONDS
    qname = DNSLabel(host)
    on_chain, cnames = cname_chain(qname, answer.answers)
    out: list[IPAddress] = []
    ttls: list[int] = []
    for rr in answer.answers:
        if rr.rtype == T_CNAME and id(rr) in cnames:
            ttls.append(rr.ttl)
        elif rr.rtype == qtype and name_key(rr.rname) in on_chain:
            ip = record_address(rr)
            if ip is not None:
                out.append(ip)
                ttls.append(rr.ttl)
    return out, float(min(ttls)) if out else DNS_CACHE_MAX_SECONDS


class DnsLookup:
    """A and AAAA (in parallel) through dns/upstream.py's client, to the configured server(s)."""

    def __init__(self, servers: tuple[tuple[str, int], ...], timeout: float) -> None:
        self.metrics = DnsMetrics()  # mismatches, TCP retries, timeouts: the same counters as the resolver's
        self.upstream = Upstream(servers, timeout, EDNS_SIZE, self.metrics)

    async def __call__(self, host: str) -> tuple[tuple[IPAddress, ...], float]:
        name = host.rstrip(".").lower()
        try:
            labels = tuple(name.encode("ascii").split(b"."))
        except UnicodeEncodeError as exc:
            raise ResolveError(f"cannot resolve {host}: not an ASCII name") from exc
        if any(not 0 < len(label) <= MAX_LABEL for label in labels) or len(name) + 2 > MAX_NAME_WIRE:
            raise ResolveError(f"cannot resolve {host}: not a valid DNS name")
        results = await asyncio.gather(
            self.upstream.resolve(labels, T_A), self.upstream.resolve(labels, T_AAAA), return_exceptions=True
        )
        out: list[IPAddress] = []
        ttl = DNS_CACHE_MAX_SECONDS
        errors: list[str] = []
        for qtype, result in zip((T_A, T_AAAA), results, strict=True):
            if isinstance(result, UpstreamFailed):
                errors.append(result.reason)
                ttl = 0.0  # one family failed: use what the other gave, but do not keep a partial answer
                continue
            if isinstance(result, BaseException):
                raise result
            addresses, family_ttl = chain_addresses(name, qtype, result)
            ttl = min(ttl, family_ttl)
            out.extend(ip for ip in addresses if ip not in out)
        if not out:
            raise ResolveError(f"cannot resolve {host}: {'; '.join(errors) or 'no A/AAAA records'}")
        return tuple(out[:MAX_ANSWERS]), ttl


class GatewayResolver:
    """A lookup with a bounded positive cache and single flight (see the module docstring)."""

    CACHE_MAX = 4096

    def __init__(self, lookup: Lookup, clock: Callable[[], float] = time.monotonic) -> None:
        self.lookup = lookup
        self._clock = clock
        self._cache: dict[str, tuple[float, tuple[IPAddress, ...]]] = {}
        self._inflight: dict[str, asyncio.Task[tuple[IPAddress, ...]]] = {}

    async def resolve(self, host: str) -> tuple[IPAddress, ...]:
        hit = self._cache.get(host)
        if hit is not None and hit[0] > self._clock():
            return hit[1]
        return await self._miss(host)

    async def _miss(self, host: str) -> tuple[IPAddress, ...]:
        task = self._inflight.get(host)
        if task is None:
            task = asyncio.ensure_future(self._fill(host))
            self._inflight[host] = task
            task.add_done_callback(lambda done: self._settled(host, done))
        # shield: one asker giving up (its client went away) must not cancel the others' lookup
        return await asyncio.shield(task)

    async def _fill(self, host: str) -> tuple[IPAddress, ...]:
        addresses, ttl = await self.lookup(host)
        if ttl > 0:
            if len(self._cache) >= self.CACHE_MAX:
                self._cache.clear()
            self._cache[host] = (self._clock() + ttl, addresses)
        return addresses

    def _settled(self, host: str, task: asyncio.Task) -> None:
        if self._inflight.get(host) is task:
            del self._inflight[host]
        if not task.cancelled():
            task.exception()  # retrieved: every asker may have gone away


def make_resolver(spec: str, timeout: float = 5.0) -> GatewayResolver:
    """`upstream.resolver`: "system" or "host:port" of a DNS server; `timeout` is the connect timeout."""
    if spec == "system":
        return GatewayResolver(SystemLookup(timeout))
    host, port = parse_listen(spec)
    return GatewayResolver(DnsLookup(((host, port),), min(timeout, DNS_TIMEOUT_MAX)))
