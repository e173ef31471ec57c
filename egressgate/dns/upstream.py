"""Forwarding allowed queries to the upstream resolvers, with spoofing resistance.

Every upstream query gets a fresh connected UDP socket (so the kernel picks a random ephemeral source port and
drops datagrams from any other address) and a fresh random 16-bit id from `secrets`. A reply is accepted only
when its source, id, QR bit and question (name case-insensitively, type and class exactly) match; anything
else is counted and ignored, and the wait goes on until the timeout. dnslib's own client checks none of this.

Failure handling: a timeout, an ICMP error, an unparseable reply or SERVFAIL/REFUSED/NOTIMP/FORMERR moves on
to the next upstream; a truncated (TC) UDP reply is retried over TCP to the same upstream. When every
upstream has failed the caller answers SERVFAIL (never NXDOMAIN: a failure must not look like "this name does
not exist").
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import secrets
import struct
from dataclasses import dataclass

from dnslib import QTYPE, RD, RDMAP, RR, DNSBuffer

from egressgate.dns.metrics import DnsMetrics
from egressgate.dns.wire import HEADER, NOERROR, NXDOMAIN, OPCODE_MASK, QR, TC, opt_record
from egressgate.dns.wire import RD as RD_FLAG

MAX_RECORDS = 256  # answer+authority records we are willing to parse from one reply
_FIXED_LEN = {1: 4, 28: 16}  # A, AAAA: the only rdata lengths we accept for them


class UpstreamFailed(Exception):
    """No upstream produced a usable answer; `reason` says why (for the audit record)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BadReply(Exception):
    """A reply that matched our query but could not be parsed safely."""


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    rcode: int  # NOERROR or NXDOMAIN (everything else is a failure)
    answers: tuple[RR, ...]
    authority: tuple[RR, ...]


def build_query(qid: int, labels: tuple[bytes, ...], qtype: int, edns_size: int) -> tuple[bytes, bytes]:
    """(packet, question bytes) for a recursive query with EDNS."""
    name = b"".join(bytes((len(label),)) + label for label in labels) + b"\x00"
    question = name + struct.pack("!HH", qtype, 1)
    return HEADER.pack(qid, RD_FLAG, 1, 0, 0, 1) + question + opt_record(edns_size), question


def reply_matches(data: bytes, qid: int, question: bytes) -> bool:
    """Cheap pre-parse check: same id, a response to a standard query, and our question echoed."""
    if len(data) < HEADER.size + len(question):
        return False
    rid, flags, qdcount = struct.unpack_from("!HHH", data)
    if rid != qid or not flags & QR or flags & OPCODE_MASK or qdcount != 1:
        return False
    echoed = data[HEADER.size : HEADER.size + len(question)]
    return echoed[:-4].lower() == question[:-4] and echoed[-4:] == question[-4:]


def parse_reply(data: bytes, question_len: int) -> tuple[int, bool, tuple[RR, ...], tuple[RR, ...]]:
    """(rcode, truncated, answers, authority) of a reply that passed `reply_matches`. Raises BadReply."""
    _, flags, _, ancount, nscount, _ = HEADER.unpack_from(data)
    if ancount + nscount > MAX_RECORDS:
        raise BadReply("too many records")
    buffer = DNSBuffer(data)
    buffer.offset = HEADER.size + question_len
    sections: list[list[RR]] = [[], []]
    try:
        for index, count in enumerate((ancount, nscount)):
            for _ in range(count):
                rname = buffer.decode_name()
                rtype, rclass, ttl, rdlength = buffer.unpack("!HHIH")
                end = buffer.offset + rdlength
                if end > len(data) or rdlength == 0 or rtype == 41:
                    raise BadReply("record runs past the end or is empty/OPT")
                if rtype in _FIXED_LEN and rdlength != _FIXED_LEN[rtype]:
                    raise BadReply("address record with a wrong length")
                rdata = RDMAP.get(QTYPE.get(rtype), RD).parse(buffer, rdlength)
                if buffer.offset != end:
                    raise BadReply("record data length mismatch")
                sections[index].append(RR(rname, rtype, rclass, ttl, rdata))
    except BadReply:
        raise
    except Exception as exc:  # dnslib raises DNSError/BufferError/ValueError; pointer chains RecursionError
        raise BadReply(f"unparseable reply: {type(exc).__name__}") from exc
    return flags & 0xF, bool(flags & TC), tuple(sections[0]), tuple(sections[1])


class _OneShot(asyncio.DatagramProtocol):
    def __init__(
        self,
        future: asyncio.Future[bytes],
        qid: int,
        question: bytes,
        server: tuple[str, int],
        metrics: DnsMetrics,
    ) -> None:
        self.future = future
        self.qid = qid
        self.question = question
        self.server = server
        self.metrics = metrics

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        if self.future.done():
            return
        if (addr[0], addr[1]) != self.server or not reply_matches(data, self.qid, self.question):
            self.metrics.upstream_mismatches += 1
            return
        self.future.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


def _canonical(host: str) -> str:
    address, _, zone = host.partition("%")
    text = str(ipaddress.ip_address(address))
    return f"{text}%{zone}" if zone else text


class Upstream:
    def __init__(
        self, servers: tuple[tuple[str, int], ...], timeout: float, edns_size: int, metrics: DnsMetrics
    ) -> None:
        # Canonical address text, because replies are matched against the source address the kernel reports.
        self.servers = tuple((_canonical(host), port) for host, port in servers)
        self.timeout = timeout
        self.edns_size = edns_size
        self.metrics = metrics

    async def resolve(self, labels: tuple[bytes, ...], qtype: int) -> UpstreamAnswer:
        """Ask each upstream in turn; raise UpstreamFailed when none answered usably."""
        if not self.servers:
            raise UpstreamFailed("no upstream resolvers configured")
        reason = "no upstream answered"
        for server in self.servers:
            try:
                return await self._ask(server, labels, qtype)
            except TimeoutError:
                self.metrics.upstream_timeouts += 1
                reason = "upstream timeout"
            except (OSError, BadReply, asyncio.IncompleteReadError) as exc:
                self.metrics.upstream_errors += 1
                reason = f"upstream error: {type(exc).__name__}"
            except UpstreamFailed as exc:
                self.metrics.upstream_errors += 1
                reason = exc.reason
        raise UpstreamFailed(reason)

    async def _ask(self, server: tuple[str, int], labels: tuple[bytes, ...], qtype: int) -> UpstreamAnswer:
        qid = secrets.randbelow(65536)
        packet, question = build_query(qid, labels, qtype, self.edns_size)
        self.metrics.upstream_queries += 1
        data = await self._udp(server, packet, qid, question)
        rcode, truncated, answers, authority = parse_reply(data, len(question))
        if truncated:
            self.metrics.upstream_tcp_retries += 1
            qid = secrets.randbelow(65536)
            packet, question = build_query(qid, labels, qtype, self.edns_size)
            data = await self._tcp(server, packet, qid, question)
            rcode, truncated, answers, authority = parse_reply(data, len(question))
            if truncated:
                raise UpstreamFailed("upstream truncated a TCP answer")
        if rcode not in (NOERROR, NXDOMAIN):
            raise UpstreamFailed(f"upstream rcode {rcode}")
        return UpstreamAnswer(rcode, answers, authority)

    async def _udp(self, server: tuple[str, int], packet: bytes, qid: int, question: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _OneShot(future, qid, question, server, self.metrics), remote_addr=server
        )
        try:
            transport.sendto(packet)
            async with asyncio.timeout(self.timeout):
                return await future
        finally:
            transport.close()

    async def _tcp(self, server: tuple[str, int], packet: bytes, qid: int, question: bytes) -> bytes:
        writer = None
        try:
            async with asyncio.timeout(self.timeout):
                reader, writer = await asyncio.open_connection(server[0], server[1])
                writer.write(struct.pack("!H", len(packet)) + packet)
                await writer.drain()
                while True:  # skip (count) replies that are not ours; the timeout bounds this loop
                    (length,) = struct.unpack("!H", await reader.readexactly(2))
                    data = await reader.readexactly(length)
                    if reply_matches(data, qid, question):
                        return data
                    self.metrics.upstream_mismatches += 1
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
