"""The gateway's name resolution: one DNS client (dns/upstream.py) for `upstream.resolver: host:port`.

A scripted DNS server on loopback (tests/gateway/scripted_dns.py: real UDP and TCP sockets) plays a hostile
or broken upstream: truncated UDP answers, forged replies (wrong id, question, QR bit, source), records for
another owner in the answer section, silence, a TCP leg that hangs. These tests drive `make_resolver`
directly; test_resolver_gateway.py runs the real gateway against the same server. Each attack comes with its
control: the same bytes without the tampering are accepted, so the test would see the planted address if it
got through.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time

import pytest

from egressgate.gateway.service.resolver import (
    DNS_CACHE_MAX_SECONDS,
    SYSTEM_CACHE_SECONDS,
    GatewayResolver,
    ResolveError,
    SystemLookup,
    make_resolver,
)
from tests.support.scripted_dns import CANARY, REAL, Plan, ScriptedDns


def resolve(resolver: GatewayResolver, host: str) -> tuple[str, ...]:
    return tuple(str(ip) for ip in asyncio.run(resolver.resolve(host)))


def dns_resolver(scripted: ScriptedDns, timeout: float = 1.0, clock=time.monotonic) -> GatewayResolver:
    resolver = make_resolver(f"127.0.0.1:{scripted.port}", timeout)
    resolver._clock = clock  # the cache's clock only; the lookups are real
    return resolver


# --------------------------------------------------------------------------------- the DNS client
def test_truncated_udp_answer_is_retried_over_tcp(scripted):
    scripted.plans["tc.test"] = Plan([("", "A", REAL), ("", "AAAA", "::1")], mode="tc")
    assert resolve(dns_resolver(scripted), "tc.test") == (REAL, "::1")
    assert scripted.queries("tc.test", "udp") == 1 and scripted.queries("tc.test", "tcp") == 1
    # control: the same records without the TC bit come straight over UDP
    scripted.plans["notc.test"] = Plan([("", "A", REAL)])
    assert resolve(dns_resolver(scripted), "notc.test") == (REAL,)
    assert scripted.queries("notc.test", "tcp") == 0


@pytest.mark.parametrize("forge", ["id", "question", "source", "qr"])
def test_forged_udp_replies_are_ignored(scripted, forge):
    """A reply naming the canary arrives first, tampered one way; the real one 50 ms later wins."""
    name = f"forge-{forge}.test"
    scripted.plans[name] = Plan([("", "A", REAL)], forge=forge)
    assert resolve(dns_resolver(scripted), name) == (REAL,)


def test_forged_reply_control_is_accepted_when_untampered(scripted):
    """The control for the test above: the same forged reply with nothing wrong in it is taken, so the
    tampered variants were ignored for their tampering and not for some other flaw."""
    scripted.plans["forge-control.test"] = Plan([("", "A", REAL)], forge="control")
    assert resolve(dns_resolver(scripted), "forge-control.test") == (CANARY,)


def test_wrong_id_reply_on_tcp_is_skipped(scripted):
    scripted.plans["tcpforge.test"] = Plan([("", "A", REAL)], mode="tc", tcp_forge=True)
    resolver = dns_resolver(scripted)
    assert resolve(resolver, "tcpforge.test") == (REAL,)
    assert resolver.lookup.metrics.upstream_mismatches >= 1


def test_records_off_the_cname_chain_are_not_addresses(scripted):
    """An answer section that carries an A record for another owner (listed first) plants nothing; the
    chain through a CNAME is followed."""
    scripted.plans["chain.test"] = Plan([
        ("canary.test", "A", CANARY),
        ("", "CNAME", "edge.cdn.test"),
        ("edge.cdn.test", "A", REAL),
        ("elsewhere.test", "AAAA", "::2"),
    ])
    assert resolve(dns_resolver(scripted), "chain.test") == (REAL,)
    # control: owned by the asked name, the same record is an address like any other
    scripted.plans["owned.test"] = Plan([("", "A", CANARY), ("", "A", REAL)])
    assert resolve(dns_resolver(scripted), "owned.test") == (CANARY, REAL)


@pytest.mark.parametrize("mode", ["silent", "tc-hang"])
def test_silence_and_a_hanging_tcp_leg_fail_within_the_timeout(scripted, mode):
    name = f"{mode}.test"
    scripted.plans[name] = Plan([("", "A", REAL)], mode=mode)
    started = time.monotonic()
    with pytest.raises(ResolveError):
        resolve(dns_resolver(scripted, timeout=0.5), name)
    assert time.monotonic() - started < 2.5  # UDP timeout + TCP timeout, and nothing more


@pytest.mark.parametrize("rcode", [2, 3, 5])
def test_error_rcodes_and_nxdomain_fail(scripted, rcode):
    scripted.plans[f"rcode{rcode}.test"] = Plan([("", "A", REAL)], rcode=rcode)
    with pytest.raises(ResolveError):
        resolve(dns_resolver(scripted), f"rcode{rcode}.test")


# --------------------------------------------------------------------------------- the cache
def test_answers_are_reused_for_their_ttl_and_no_longer(scripted):
    now = [1000.0]
    resolver = dns_resolver(scripted, clock=lambda: now[0])
    scripted.plans["ttl.test"] = Plan([("", "A", REAL)], ttl=30)
    assert resolve(resolver, "ttl.test") == (REAL,)
    assert resolve(resolver, "ttl.test") == (REAL,)
    assert scripted.queries("ttl.test") == 1
    scripted.plans["ttl.test"] = Plan([("", "A", "127.0.0.3")], ttl=30)
    now[0] += 30.01
    assert resolve(resolver, "ttl.test") == ("127.0.0.3",)  # expired: asked again, new answer
    assert scripted.queries("ttl.test") == 2


def test_ttl_zero_is_never_reused_and_long_ttls_are_capped(scripted):
    now = [1000.0]
    resolver = dns_resolver(scripted, clock=lambda: now[0])
    scripted.plans["ttl0.test"] = Plan([("", "A", REAL)], ttl=0)
    for _ in range(3):
        resolve(resolver, "ttl0.test")
    assert scripted.queries("ttl0.test") == 3
    scripted.plans["ttllong.test"] = Plan([("", "A", REAL)], ttl=86400)
    resolve(resolver, "ttllong.test")
    now[0] += DNS_CACHE_MAX_SECONDS - 1
    resolve(resolver, "ttllong.test")
    assert scripted.queries("ttllong.test") == 1
    now[0] += 2
    resolve(resolver, "ttllong.test")
    assert scripted.queries("ttllong.test") == 2


def test_the_smallest_ttl_on_the_chain_bounds_reuse(scripted):
    now = [1000.0]
    resolver = dns_resolver(scripted, clock=lambda: now[0])
    scripted.plans["short.test"] = Plan([("", "CNAME", "long.test"), ("long.test", "A", REAL)], ttl=10)
    resolve(resolver, "short.test")
    now[0] += 10.5
    resolve(resolver, "short.test")
    assert scripted.queries("short.test") == 2


def test_failures_are_never_cached(scripted):
    resolver = dns_resolver(scripted)
    scripted.plans["flaky.test"] = Plan([("", "A", REAL)], rcode=2)
    with pytest.raises(ResolveError):
        resolve(resolver, "flaky.test")
    scripted.plans["flaky.test"] = Plan([("", "A", REAL)])
    assert resolve(resolver, "flaky.test") == (REAL,)


def test_concurrent_lookups_of_one_name_share_one_query(scripted):
    scripted.plans["burst.test"] = Plan([("", "A", REAL)], ttl=0, delay=0.2)
    resolver = dns_resolver(scripted)

    async def burst():
        return await asyncio.gather(*(resolver.resolve("burst.test") for _ in range(20)))

    answers = asyncio.run(burst())
    assert {tuple(map(str, a)) for a in answers} == {(REAL,)}
    assert scripted.queries("burst.test") == 1


def test_an_asker_that_gives_up_does_not_cancel_the_shared_lookup(scripted):
    """The first asker's client goes away mid-lookup (its task is cancelled, as mitmproxy does when a
    connection closes); the others waiting on the same name still get the answer, from the one query.
    Also under mitmproxy's eager task factory, where the shared lookup starts running at creation."""
    scripted.plans["gone.test"] = Plan([("", "A", REAL)], ttl=0, delay=0.2)

    async def run(eager: bool):
        if eager:
            asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
        resolver = dns_resolver(scripted)
        first = asyncio.ensure_future(resolver.resolve("gone.test"))
        others = [asyncio.ensure_future(resolver.resolve("gone.test")) for _ in range(3)]
        await asyncio.sleep(0.05)
        first.cancel()
        answers = await asyncio.gather(*others)
        assert first.cancelled()
        return {tuple(map(str, a)) for a in answers}

    for eager in (False, True):
        before = scripted.queries("gone.test")
        assert asyncio.run(run(eager)) == {(REAL,)}
        assert scripted.queries("gone.test") == before + 1


def test_system_lookup_is_real_getaddrinfo_reused_briefly():
    addresses, ttl = asyncio.run(SystemLookup(5)("localhost"))
    assert ipaddress.ip_address("127.0.0.1") in addresses or ipaddress.ip_address("::1") in addresses
    assert ttl == SYSTEM_CACHE_SECONDS
    with pytest.raises(ResolveError):
        asyncio.run(SystemLookup(5)("no-such-name.invalid"))
