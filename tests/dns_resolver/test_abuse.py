"""Hostile input: garbage, truncated and oversize packets, odd opcodes, over-long names, TCP abuse.

After every bad input the server must still answer a good query (it did not crash, hang or wedge a slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct

import dns.message
import dns.rcode
from dnslib import DNSRecord

from tests.support.dnsclients import SANDBOX_IP, addresses, ask, dig, raw_udp, rcode

FORMERR, NOTIMP, REFUSED, NXDOMAIN = 1, 4, 5, 3


def header(qid=0x1234, flags=0x0100, qd=1, an=0, ns=0, ar=0) -> bytes:
    return struct.pack("!HHHHHH", qid, flags, qd, an, ns, ar)


def qname(*labels: bytes) -> bytes:
    return b"".join(bytes((len(label),)) + label for label in labels) + b"\x00"


GOOD = header() + qname(b"allowed", b"example", b"com") + struct.pack("!HH", 1, 1)


async def still_serving(server) -> None:
    response = await ask(server, "allowed.example.com")
    assert rcode(response) == "NOERROR" and addresses(response) == ["93.184.216.34"]


def reply_rcode(reply: bytes) -> int:
    return struct.unpack_from("!H", reply, 2)[0] & 0xF


async def test_garbage_and_truncated_packets_dropped_or_formerr(server, upstream):
    rng = random.Random(4)
    inputs = [b"", b"\x00", b"\xff" * 11, header(qd=0), GOOD[:-1], GOOD[:13], GOOD[:20]]
    inputs += [GOOD[:n] for n in range(0, len(GOOD), 3)]
    inputs += [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 600))) for _ in range(40)]
    for packet in inputs:
        reply = await raw_udp(server, packet, timeout=0.05)
        if reply is not None:
            assert len(reply) >= 12 and reply[2] & 0x80, packet  # an answer (QR), never an echo
            assert reply_rcode(reply) in (FORMERR, NOTIMP, REFUSED, NXDOMAIN), packet
        await still_serving(server)
    assert server.metrics.internal_errors == 0
    assert server.metrics.dropped_malformed > 0 and server.metrics.formerr > 0
    assert set(upstream.names()) <= {"allowed.example.com"}


async def test_structural_errors_get_formerr(server, upstream):
    cases = {
        "two questions": header(qd=2) + qname(b"a", b"com") + b"\x00\x01\x00\x01" * 2,
        "label of 64": header() + qname(b"a" * 64, b"com") + b"\x00\x01\x00\x01",
        "compression pointer": header() + b"\xc0\x0c" + b"\x00\x01\x00\x01",
        "name over 255 octets": header() + qname(*([b"a" * 63] * 4)) + b"\x00\x01\x00\x01",
        "label past end": header() + b"\x20abc",
        "answer in query": header(an=1) + qname(b"a", b"com") + b"\x00\x01\x00\x01",
        "two additionals": header(ar=2) + qname(b"a", b"com") + b"\x00\x01\x00\x01",
        "bad OPT": header(ar=1) + qname(b"a", b"com") + b"\x00\x01\x00\x01" + b"\x00\x00\x01\x10\x00",
        "binary label": header() + qname(b"a\x00b", b"example", b"com") + b"\x00\x01\x00\x01",
        "dot in label": header() + qname(b"allowed.example", b"com") + b"\x00\x01\x00\x01",
        "space in label": header() + qname(b"all owed", b"example", b"com") + b"\x00\x01\x00\x01",
    }
    for what, packet in cases.items():
        reply = await raw_udp(server, packet)
        assert reply is not None, what
        assert reply_rcode(reply) == FORMERR, what
        assert reply[:2] == b"\x12\x34", what
        await still_serving(server)
    assert upstream.names() == ["allowed.example.com"]  # only the liveness probe, cached after the first


async def test_max_length_names(server, upstream):
    label63 = b"a" * 63
    ok = header() + qname(label63, b"example", b"com") + b"\x00\x01\x00\x01"
    assert reply_rcode(await raw_udp(server, ok)) == NXDOMAIN  # well-formed, just not allowed
    longest = header() + qname(label63, label63, label63, b"a" * 61) + b"\x00\x01\x00\x01"  # 253 chars
    assert reply_rcode(await raw_udp(server, longest)) == NXDOMAIN
    too_long = header() + qname(label63, label63, label63, b"a" * 62) + b"\x00\x01\x00\x01"  # 254 chars
    assert reply_rcode(await raw_udp(server, too_long)) == FORMERR
    assert upstream.seen == []


async def test_opcodes_and_responses(server):
    for opcode in (1, 2, 4, 5, 15):
        reply = await raw_udp(server, header(flags=opcode << 11) + qname(b"a", b"com") + b"\x00\x01\x00\x01")
        assert reply is not None and reply_rcode(reply) == NOTIMP, opcode
        await still_serving(server)
    # a packet with QR set is a response: answering it would allow reflection loops
    assert await raw_udp(server, header(flags=0x8180) + qname(b"a", b"com") + b"\x00\x01\x00\x01") is None
    assert server.metrics.dropped_responses == 1
    await still_serving(server)


async def test_oversize_query_dropped(server):
    packet = GOOD + b"\x00" * 2000
    assert await raw_udp(server, packet) is None
    assert server.metrics.dropped_oversize == 1
    await still_serving(server)


async def test_edns_version_and_class(server, upstream):
    query = dns.message.make_query("allowed.example.com", "A", use_edns=1)
    reply = dns.message.from_wire(await raw_udp(server, query.to_wire()))
    assert reply.rcode() == dns.rcode.BADVERS
    out = await dig(server, "version.bind", "TXT", "CH")
    assert "status: REFUSED" in out
    assert upstream.seen == []
    await still_serving(server)


async def _tcp_exchange(server, payload: bytes, expect: int, source: str = SANDBOX_IP) -> list[bytes]:
    reader, writer = await asyncio.open_connection(*server.address, local_addr=(source, 0))
    try:
        writer.write(payload)
        await writer.drain()
        answers = []
        for _ in range(expect):
            (length,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 3))
            answers.append(await reader.readexactly(length))
        return answers
    finally:
        writer.close()


async def wait_until(condition, seconds: float = 3.0) -> None:
    for _ in range(int(seconds * 100)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def wait_for_inflight(srv, n: int) -> None:
    """Until `n` UDP queries are in progress (the slow ones reached the server)."""
    await wait_until(lambda: len(srv._udp.tasks) >= n)


def framed(packet: bytes) -> bytes:
    return struct.pack("!H", len(packet)) + packet


async def test_tcp_pipelined_queries(server, upstream):
    names = [
        "allowed.example.com",
        "x.wild.example.com",
        "evil.example.org",
        "cname-ok.example.com",
        "mixed.example.com",
    ]
    queries = [DNSRecord.question(name) for name in names]
    for i, q in enumerate(queries):
        q.header.id = 1000 + i
    answers = await _tcp_exchange(server, b"".join(framed(q.pack()) for q in queries), len(queries))
    by_id = {DNSRecord.parse(a).header.id: DNSRecord.parse(a) for a in answers}
    assert sorted(by_id) == [1000, 1001, 1002, 1003, 1004]
    assert str(by_id[1000].rr[0].rdata) == "93.184.216.34"
    assert by_id[1002].header.rcode == NXDOMAIN
    assert [str(r.rdata) for r in by_id[1004].rr] == ["93.184.216.41"]
    assert "evil.example.org" not in upstream.names()


async def test_tcp_garbage_then_good_on_same_connection(server):
    garbage = framed(b"") + framed(b"\x01\x02\x03") + framed(header(flags=2 << 11) + qname(b"a") + b"\0\1\0\1")
    good = DNSRecord.question("allowed.example.com")
    answers = await _tcp_exchange(server, garbage + framed(good.pack()), 2)
    assert reply_rcode(answers[0]) == NOTIMP
    assert DNSRecord.parse(answers[1]).header.id == good.header.id
    # a length prefix promising more than is sent, then close: the server must just drop the connection
    _reader, writer = await asyncio.open_connection(*server.address, local_addr=(SANDBOX_IP, 0))
    writer.write(b"\x10\x00" + b"abc")
    writer.close()
    await still_serving(server)


async def test_tcp_idle_timeout_closes(server):
    reader, writer = await asyncio.open_connection(*server.address, local_addr=(SANDBOX_IP, 0))
    try:
        data = await asyncio.wait_for(reader.read(10), 3)  # idle timeout is 1 s in the test config
        assert data == b""
    finally:
        writer.close()
    assert server.metrics.tcp_idle_closed == 1
    await still_serving(server)


async def test_tcp_connection_cap(server):
    conns = [await asyncio.open_connection(*server.address, local_addr=(SANDBOX_IP, 0)) for _ in range(8)]
    await wait_until(lambda: len(server._connections) == 8)
    reader, writer = await asyncio.open_connection(*server.address, local_addr=(SANDBOX_IP, 0))
    assert await asyncio.wait_for(reader.read(10), 2) == b""  # the ninth is closed at once
    writer.close()
    assert server.metrics.tcp_rejected == 1
    for _, w in conns:
        w.close()
    await wait_until(lambda: not server._connections)
    response = await ask(server, "allowed.example.com", tcp=True)  # capacity is back
    assert addresses(response) == ["93.184.216.34"]


async def test_udp_overload_is_dropped_not_queued(policies, state, audit, upstream, dns_config):
    from dataclasses import replace

    from egressgate.dns.server import DnsServer

    upstream.behaviour["slow.example.com"] = "timeout"
    srv = DnsServer(policies.get, state, audit, replace(dns_config, udp_max_inflight=2))
    await srv.start("127.0.0.1", 0)
    try:
        pending = [asyncio.ensure_future(ask(srv, "slow.example.com", timeout=2)) for _ in range(2)]
        await wait_for_inflight(srv, 2)
        assert await raw_udp(srv, GOOD, timeout=0.2) is None  # slots are full: dropped
        assert srv.metrics.dropped_overload >= 1
        results = await asyncio.gather(*pending)
        assert all(rcode(r) == "SERVFAIL" for r in results)
        assert rcode(await ask(srv, "allowed.example.com")) == "NOERROR"
    finally:
        await srv.stop()


async def test_per_client_caps_keep_other_sandboxes_served(policies, state, audit, upstream, dns_config):
    from dataclasses import replace

    from egressgate.dns.server import DnsServer
    from tests.support.dnsclients import PRIVATE_IP

    upstream.behaviour["slow.example.com"] = "timeout"
    config = replace(dns_config, udp_max_inflight_per_client=2, tcp_max_per_client=2)
    srv = DnsServer(policies.get, state, audit, config)
    await srv.start("127.0.0.1", 0)
    try:
        pending = [asyncio.ensure_future(ask(srv, "slow.example.com", timeout=2)) for _ in range(2)]
        await wait_for_inflight(srv, 2)
        assert await raw_udp(srv, GOOD, timeout=0.2) is None  # this sandbox's slots are full
        other = await ask(srv, "allowed.example.com", source=PRIVATE_IP)  # another sandbox still served
        assert addresses(other) == ["93.184.216.34"]
        await asyncio.gather(*pending)
        assert rcode(await ask(srv, "allowed.example.com")) == "NOERROR"  # slots released

        conns = [await asyncio.open_connection(*srv.address, local_addr=(SANDBOX_IP, 0)) for _ in range(2)]
        await wait_until(lambda: len(srv._connections) == 2)
        reader, writer = await asyncio.open_connection(*srv.address, local_addr=(SANDBOX_IP, 0))
        assert await asyncio.wait_for(reader.read(10), 2) == b""  # third from the same source: closed
        writer.close()
        assert addresses(await ask(srv, "allowed.example.com", source=PRIVATE_IP, tcp=True)) == ["93.184.216.34"]
        for _, w in conns:
            w.close()
    finally:
        await srv.stop()


async def test_tcp_client_that_never_reads_is_dropped(server):
    """Pipelined queries whose answers are never read: the server must not hold the connection forever."""
    query = DNSRecord.question("huge.example.com")  # ~2.4 KB answers
    _reader, writer = await asyncio.open_connection(*server.address, local_addr=(SANDBOX_IP, 0))
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        writer.write(framed(query.pack()) * 4000)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        for _ in range(60):
            if server.metrics.tcp_idle_closed:
                break
            await asyncio.sleep(0.1)
        assert server.metrics.tcp_idle_closed >= 1
        await asyncio.sleep(0.1)
        assert not server._connections  # the slot is free again
    finally:
        writer.close()
    await still_serving(server)
