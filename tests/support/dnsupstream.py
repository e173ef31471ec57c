"""A recording upstream DNS server on loopback for the resolver tests, answering from an in-memory zone.

It records every query it receives (name, type, transport), which is how the tests prove that a denied
name never left the resolver; per-name behaviours make it hostile (timeouts, SERVFAIL, malformed records,
forged replies with a wrong id, source or question, truncation that forces TCP).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass, field

from dnslib import QTYPE, RCODE, RR, A, DNSHeader, DNSQuestion, DNSRecord

# name -> list of zone lines (answer section) for the upstream
ZONE: dict[str, list[str]] = {
    "allowed.example.com": [
        "allowed.example.com. 300 A 93.184.216.34",
        "allowed.example.com. 300 AAAA 2606:2800:220:1:248:1893:25c8:1946",
    ],
    "api.example.net": ["api.example.net. 300 A 93.184.216.35"],
    "x.wild.example.com": ["x.wild.example.com. 300 A 93.184.216.36"],
    "private.example.com": ["private.example.com. 300 A 10.1.2.3"],
    "loop.example.com": ["loop.example.com. 300 A 127.0.0.1", "loop.example.com. 300 AAAA ::1"],
    "meta.example.com": ["meta.example.com. 300 A 169.254.169.254"],
    "mapped.example.com": ["mapped.example.com. 300 AAAA ::ffff:7f00:1"],  # ::ffff:127.0.0.1
    "nat64.example.com": ["nat64.example.com. 300 AAAA 64:ff9b::a9fe:a9fe"],  # NAT64 of 169.254.169.254
    "cgnat.example.com": ["cgnat.example.com. 300 A 100.100.100.200"],
    "cname-private.example.com": [
        "cname-private.example.com. 300 CNAME internal.corp.example.",
        "internal.corp.example. 300 A 192.168.1.10",
    ],
    "cname-ok.example.com": [
        "cname-ok.example.com. 300 CNAME edge.cdn.example.",
        "edge.cdn.example. 300 A 93.184.216.40",
    ],
    "mixed.example.com": [
        "mixed.example.com. 300 A 93.184.216.41",
        "mixed.example.com. 300 A 10.9.9.9",
        "mixed.example.com. 300 A 169.254.169.254",
    ],
    # injection: records for names not on the chain, and a second chain to loopback
    "inject.example.com": [
        "inject.example.com. 300 A 93.184.216.42",
        "victim.example.org. 300 A 127.0.0.1",
        "allowed.example.com. 300 A 10.0.0.1",
    ],
    "big.example.com": [f"big.example.com. 300 A 93.184.{i // 250}.{i % 250 + 1}" for i in range(60)],
    "huge.example.com": [f"huge.example.com. 300 A 93.185.{i // 250}.{i % 250 + 1}" for i in range(150)],
    "cached.example.com": ["cached.example.com. 300 A 93.184.216.43"],
    "bench.example.com": ["bench.example.com. 300 A 93.184.216.44"],
    "svc.example.com": [
        "svc.example.com. 300 HTTPS 1 . alpn=h2 ipv4hint=10.0.0.1 ipv6hint=::1",
        "svc.example.com. 300 HTTPS 2 . alpn=h3 mandatory=ipv4hint ipv4hint=127.0.0.1",
    ],
    "txt.example.com": ['txt.example.com. 300 TXT "v=exfil-capable"'],
    "a.budget.example.com": ["a.budget.example.com. 300 A 93.184.216.50"],
    "b.budget.example.com": ["b.budget.example.com. 300 A 93.184.216.51"],
    "c.budget.example.com": ["c.budget.example.com. 300 A 93.184.216.52"],
    "d.budget.example.com": ["d.budget.example.com. 300 A 93.184.216.53"],
}
POISON = "93.184.216.99"  # what forged replies claim; must never reach a client
SOA = "example.com. 300 SOA ns.example.com. host.example.com. 1 7200 900 1209600 30"


@dataclass
class FakeUpstream:
    """A recording authoritative-style server. Behaviours per name: 'timeout' (never answers), 'servfail',
    'badlen' (A record with 8-byte rdata), and forged replies carrying POISON sent before the real answer:
    'spoof' (wrong id), 'spoof-source' (right id, sent from 127.0.0.8), 'spoof-question' (right id and
    source, another question)."""

    zone: dict[str, list[str]] = field(default_factory=lambda: dict(ZONE))
    behaviour: dict[str, str] = field(default_factory=dict)
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # (name, qtype, transport)
    address: tuple[str, int] = ("127.0.0.1", 0)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.seen]

    def _reply(self, data: bytes, transport: str, limit: int | None) -> bytes | None:
        request = DNSRecord.parse(data)
        name = str(request.q.qname).rstrip(".").lower()
        self.seen.append((name, QTYPE[request.q.qtype], transport))
        mode = self.behaviour.get(name)
        if mode == "timeout":
            return None
        reply = request.reply()
        reply.header.aa = 1
        if mode == "servfail":
            reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        if name not in self.zone:
            reply.header.rcode = RCODE.NXDOMAIN
            reply.add_auth(*RR.fromZone(SOA))
            return reply.pack()
        for line in self.zone[name]:
            for rr in RR.fromZone(line):
                if rr.rtype == request.q.qtype or rr.rtype == QTYPE.CNAME or name == "inject.example.com":
                    reply.add_answer(rr)
        if not reply.rr:
            reply.add_auth(*RR.fromZone(SOA))
        packed = reply.pack()
        if mode == "badlen":
            # rewrite the first A rdata length from 4 to 8 (and append 4 bytes): a malformed record
            idx = packed.rfind(b"\x00\x01\x00\x01\x00\x00\x01\x2c\x00\x04")
            packed = packed[: idx + 8] + b"\x00\x08" + packed[idx + 10 :] + b"\x7f\x00\x00\x01"
        if limit is not None and len(packed) > limit:
            trunc = request.reply()
            trunc.header.tc = 1
            return trunc.pack()
        return packed

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        upstream = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport):
                self.transport = transport

            def datagram_received(self, data, addr):
                request = DNSRecord.parse(data)
                limit = max(512, request.ar[0].edns_len) if request.ar else 512
                answer = upstream._reply(data, "udp", limit)
                if answer is None:
                    return
                name = str(request.q.qname).rstrip(".").lower()
                mode = upstream.behaviour.get(name, "")
                if mode.startswith("spoof"):
                    # A forged reply carrying the POISON address arrives first; the real one 30 ms later.
                    qid = request.header.id if mode != "spoof" else (request.header.id + 1) % 65536
                    qname = "other.example.com" if mode == "spoof-question" else request.q.qname
                    forged = DNSRecord(DNSHeader(id=qid, qr=1, aa=1, ra=1), q=DNSQuestion(qname, request.q.qtype))
                    forged.add_answer(RR(qname, QTYPE.A, rdata=A(POISON), ttl=300))
                    sender = upstream.other_source if mode == "spoof-source" else None
                    if sender is not None:
                        sender.sendto(forged.pack(), addr)
                    else:
                        self.transport.sendto(forged.pack(), addr)
                    loop.call_later(0.03, self.transport.sendto, answer, addr)
                    return
                self.transport.sendto(answer, addr)

        for _ in range(20):  # a free UDP port whose TCP twin is free too
            self.udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=("127.0.0.1", 0))
            port = self.udp.get_extra_info("sockname")[1]
            try:
                self.tcp = await asyncio.start_server(self._serve_tcp, "127.0.0.1", port)
                break
            except OSError:
                self.udp.close()
        else:
            raise OSError("no free UDP+TCP port pair for the test upstream")
        self.address = ("127.0.0.1", port)
        self.other_source = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.other_source.bind(("127.0.0.8", 0))

    async def _serve_tcp(self, reader, writer):
        try:
            while True:
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                answer = self._reply(await reader.readexactly(length), "tcp", None)
                if answer is not None:
                    writer.write(struct.pack("!H", len(answer)) + answer)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.other_source.close()
        self.udp.close()
        self.tcp.close()
