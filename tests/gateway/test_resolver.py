"""The gateway's name resolution: one DNS client (dns/upstream.py) for `upstream.resolver: host:port`.

A scripted DNS server on loopback (real UDP and TCP sockets) plays a hostile or broken upstream:
truncated UDP answers, forged replies (wrong id, wrong question, wrong source), records for another
owner in the answer section, silence, a TCP leg that hangs. Unit tests drive `make_resolver` directly;
the end-to-end tests run the real gateway against the same server and watch the real upstream and the
canary (127.0.0.2) in tests/gateway/conftest.py's world. Each attack comes with its control: the same
bytes without the tampering are accepted, so the test would see the planted address if it got through.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import struct
import threading
import time
from dataclasses import dataclass, field

import pytest
from dnslib import AAAA, CNAME, QTYPE, RR, A, DNSQuestion, DNSRecord

from egressgate.gateway.resolver import (
    DNS_CACHE_MAX_SECONDS,
    SYSTEM_CACHE_SECONDS,
    GatewayResolver,
    ResolveError,
    SystemLookup,
    make_resolver,
)

from .conftest import LoopThread, connect_tunnel, read_response, start_gateway, stop_gateway, tls_wrap

CANARY = "127.0.0.2"
REAL = "127.0.0.1"


# --------------------------------------------------------------------------------- scripted upstream
@dataclass
class Plan:
    """How the scripted server answers one name."""

    records: list[tuple[str, str, str]] = field(default_factory=list)  # (owner, type, value); "" = qname
    ttl: int = 30
    rcode: int = 0
    mode: str = "udp"  # udp | tc (UDP says truncated, TCP answers) | silent | tc-hang (TCP never answers)
    forge: str | None = None  # id | question | source | qr | control: a reply naming CANARY sent first
    tcp_forge: bool = False  # on TCP, a wrong-id reply naming CANARY precedes the real one
    delay: float = 0.0  # seconds before the real reply (UDP and TCP)


class ScriptedDns:
    """UDP + TCP DNS server on 127.0.0.1 in a loop thread; `log` lists (transport, name, qtype)."""

    def __init__(self) -> None:
        self.plans: dict[str, Plan] = {}
        self.log: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.loop = LoopThread()
        self.port, self.spoof_port = self.loop.run(self._start())

    async def _start(self) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        server = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr) -> None:
                server._udp(self.transport, data, addr)

        self.udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=(REAL, 0))
        self.tcp = await asyncio.start_server(self._tcp, REAL, self.udp.get_extra_info("sockname")[1])
        # a second socket on the same address: datagrams from here have the wrong source port
        self.spoof, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=(REAL, 0))
        return self.udp.get_extra_info("sockname")[1], self.spoof.get_extra_info("sockname")[1]

    def close(self) -> None:
        async def stop() -> None:
            self.udp.close()
            self.spoof.close()
            self.tcp.close()

        self.loop.run(stop())
        self.loop.stop()

    def queries(self, name: str, transport: str | None = None, qtype: str = "A") -> int:
        with self.lock:
            return sum(1 for t, n, q in self.log if n == name and q == qtype and transport in (None, t))

    def _reply(self, request: DNSRecord, plan: Plan | None, addresses: list[tuple[str, str]] | None = None):
        reply = request.reply()
        q = request.q
        qtype = QTYPE[q.qtype]
        if plan is None:
            reply.header.rcode = 3
            return reply
        reply.header.rcode = plan.rcode
        for owner, rtype, value in addresses if addresses is not None else plan.records:
            name = owner or str(q.qname)
            if rtype == "CNAME":
                reply.add_answer(RR(name, QTYPE.CNAME, rdata=CNAME(value), ttl=plan.ttl))
            elif rtype == qtype == "A":
                reply.add_answer(RR(name, QTYPE.A, rdata=A(value), ttl=plan.ttl))
            elif rtype == qtype == "AAAA":
                reply.add_answer(RR(name, QTYPE.AAAA, rdata=AAAA(value), ttl=plan.ttl))
        return reply

    def _udp(self, transport, data: bytes, addr) -> None:
        request = DNSRecord.parse(data)
        name, qtype = str(request.q.qname).rstrip(".").lower(), QTYPE[request.q.qtype]
        with self.lock:
            self.log.append(("udp", name, qtype))
        plan = self.plans.get(name)
        if plan is not None and plan.mode == "silent":
            return
        if plan is not None and plan.forge and qtype == "A":
            forged = self._reply(request, plan, [("", "A", CANARY)])
            sender = transport
            if plan.forge == "id":
                forged.header.id = (request.header.id + 1) % 65536
            elif plan.forge == "question":
                forged.questions = [DNSQuestion("evil." + name, QTYPE.A)]  # reply() shares q
                forged.rr = [RR("evil." + name, QTYPE.A, rdata=A(CANARY), ttl=plan.ttl)]
            elif plan.forge == "qr":
                forged.header.qr = 0
            elif plan.forge == "source":
                sender = self.spoof
            sender.sendto(forged.pack(), addr)
        reply = self._reply(request, plan)
        if plan is not None and plan.mode in ("tc", "tc-hang"):
            reply.rr = []
            reply.header.tc = 1
        delay = plan.delay if plan is not None else 0.0
        # the real reply leaves after the forged one (and after `delay`)
        asyncio.get_running_loop().call_later(max(delay, 0.05 if plan and plan.forge else 0), transport.sendto,
                                              reply.pack(), addr)

    async def _tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                request = DNSRecord.parse(await reader.readexactly(length))
                name, qtype = str(request.q.qname).rstrip(".").lower(), QTYPE[request.q.qtype]
                with self.lock:
                    self.log.append(("tcp", name, qtype))
                plan = self.plans.get(name)
                if plan is not None and plan.mode == "tc-hang":
                    await reader.read()  # hold the connection open, answer nothing
                    return
                if plan is not None and plan.tcp_forge and qtype == "A":
                    forged = self._reply(request, plan, [("", "A", CANARY)])
                    forged.header.id = (request.header.id + 1) % 65536
                    packed = forged.pack()
                    writer.write(struct.pack("!H", len(packed)) + packed)
                if plan is not None and plan.delay:
                    await asyncio.sleep(plan.delay)
                packed = self._reply(request, plan).pack()
                writer.write(struct.pack("!H", len(packed)) + packed)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture(scope="module")
def scripted():
    server = ScriptedDns()
    try:
        yield server
    finally:
        server.close()


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


def test_system_lookup_is_real_getaddrinfo_reused_briefly():
    addresses, ttl = asyncio.run(SystemLookup(5)("localhost"))
    assert ipaddress.ip_address("127.0.0.1") in addresses or ipaddress.ip_address("::1") in addresses
    assert ttl == SYSTEM_CACHE_SECONDS
    with pytest.raises(ResolveError):
        asyncio.run(SystemLookup(5)("no-such-name.invalid"))


# --------------------------------------------------------------------------------- through the gateway
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
    status, _, body = read_response(tls)
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
