"""Strict parsing of client queries and cheap packing of answers without records.

Why not dnslib's `DNSRecord.parse` for queries: it follows compression pointers recursively (a crafted chain
raises RecursionError, which it does not catch), accepts names longer than 255 bytes and parses every record
of every section before we can look at the header. A query has one fixed shape, so we check that shape byte by
byte: header, exactly one question whose name uses no compression, and at most one OPT record. Everything else
is FORMERR (or dropped when there is not even a header to answer). Answers carrying records are packed with
dnslib (resolver.py); answers without records (denials, errors, truncation) are built here from the header and
the question bytes exactly as the client sent them, which is both faster and byte-exact.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

HEADER = struct.Struct("!HHHHHH")
OPT_TYPE = 41
CLASS_IN = 1

# RCODEs (RFC 1035 / 6895)
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
RCODE_BY_NAME = {
    "NOERROR": NOERROR,
    "FORMERR": FORMERR,
    "SERVFAIL": SERVFAIL,
    "NXDOMAIN": NXDOMAIN,
    "NOTIMP": NOTIMP,
    "REFUSED": REFUSED,
}

# Header flag bits
QR = 0x8000
OPCODE_MASK = 0x7800
AA = 0x0400
TC = 0x0200
RD = 0x0100
RA = 0x0080
CD = 0x0010

MAX_NAME_WIRE = 255  # RFC 1035: 255 octets on the wire = 253 characters of text without the final dot
MAX_LABEL = 63
_PRINTABLE = frozenset(range(0x21, 0x7F)) - {ord(".")}


class Drop(Exception):
    """Nothing can be answered (no complete header, or a response). `metric` names the counter."""

    def __init__(self, metric: str) -> None:
        super().__init__(metric)
        self.metric = metric


class Malformed(Exception):
    """The header is readable but the query is not acceptable; answer `rcode` (FORMERR or NOTIMP)."""

    def __init__(self, rcode: int, message: str, header: tuple[int, int], question: bytes = b"") -> None:
        super().__init__(message)
        self.rcode = rcode
        self.header = header  # (id, flags) of the query
        self.question = question  # raw question bytes when they parsed, else b""


@dataclass(frozen=True, slots=True)
class Query:
    id: int
    flags: int
    labels: tuple[bytes, ...]  # as sent (case preserved)
    qtype: int
    qclass: int
    question: bytes  # raw question section, echoed verbatim in answers
    edns: bool
    edns_size: int  # client's advertised UDP payload size (512 without EDNS)
    edns_version: int

    @property
    def name_text(self) -> str:
        """The name as dotted text (no trailing dot); every byte is printable ASCII and not a dot."""
        return b".".join(self.labels).decode("ascii")

    @property
    def name_ok(self) -> bool:
        """False when a label holds a dot or a non-printable/non-ASCII byte: no hostname looks like that, and
        such a name cannot be written as text without an escaping scheme that would differ between us and the
        canonicalizer."""
        return all(_PRINTABLE.issuperset(label) for label in self.labels)


def parse_query(packet: bytes, max_size: int) -> Query:
    """Parse one client query. Raises Drop or Malformed; never anything else for any input bytes."""
    if len(packet) > max_size:
        raise Drop("dropped_oversize")
    if len(packet) < HEADER.size:
        raise Drop("dropped_malformed")
    qid, flags, qdcount, ancount, nscount, arcount = HEADER.unpack_from(packet)
    if flags & QR:
        raise Drop("dropped_responses")
    head = (qid, flags)
    if flags & OPCODE_MASK:
        raise Malformed(NOTIMP, "only standard queries (opcode 0) are supported", head)
    if qdcount != 1:
        raise Malformed(FORMERR, "exactly one question is required", head)
    offset = HEADER.size
    labels: list[bytes] = []
    wire_len = 1
    while True:
        if offset >= len(packet):
            raise Malformed(FORMERR, "question name runs past the end of the packet", head)
        length = packet[offset]
        offset += 1
        if length == 0:
            break
        if length > MAX_LABEL:
            # 0xC0 pointers and the obsolete 0x40/0x80 label types: no client needs them in a question.
            raise Malformed(FORMERR, "compressed or over-long label in question", head)
        wire_len += length + 1
        if wire_len > MAX_NAME_WIRE:
            raise Malformed(FORMERR, "name longer than 255 octets", head)
        if offset + length > len(packet):
            raise Malformed(FORMERR, "label runs past the end of the packet", head)
        labels.append(packet[offset : offset + length])
        offset += length
    if offset + 4 > len(packet):
        raise Malformed(FORMERR, "question has no type/class", head)
    qtype, qclass = struct.unpack_from("!HH", packet, offset)
    offset += 4
    question = packet[HEADER.size : offset]
    if ancount or nscount or arcount > 1:
        raise Malformed(FORMERR, "a query carries no answer/authority records and at most one OPT", head, question)
    edns, edns_size, edns_version = False, 512, 0
    if arcount == 1:
        # OPT: root name (one zero byte), type 41, class = payload size, ttl = ext-rcode/version/flags, rdata.
        if offset + 11 > len(packet) or packet[offset] != 0:
            raise Malformed(FORMERR, "additional record is not a well-formed OPT", head, question)
        rtype, size, _ext, version, _flags, rdlen = struct.unpack_from("!HHBBHH", packet, offset + 1)
        if rtype != OPT_TYPE or offset + 11 + rdlen > len(packet):
            raise Malformed(FORMERR, "additional record is not a well-formed OPT", head, question)
        edns, edns_size, edns_version = True, max(512, size), version
    return Query(qid, flags, tuple(labels), qtype, qclass, question, edns, edns_size, edns_version)


def opt_record(payload_size: int, ext_rcode: int = 0) -> bytes:
    """Our OPT pseudo-record: root owner, type 41, class = payload size, version 0, no flags. `ext_rcode` is
    the upper 8 bits of a 12-bit rcode (1 = BADVERS when the header rcode is 0)."""
    return b"\x00" + struct.pack("!HHBBHH", OPT_TYPE, payload_size, ext_rcode, 0, 0, 0)


def bare_response(qid: int, qflags: int, rcode: int, question: bytes, opt: bytes = b"", tc: bool = False) -> bytes:
    """An answer with no records: header + the client's question verbatim (+ OPT). RD and CD are echoed."""
    flags = QR | RA | (qflags & (RD | CD)) | (rcode & 0xF) | (TC if tc else 0)
    return HEADER.pack(qid, flags, 1 if question else 0, 0, 0, 1 if opt else 0) + question + opt


def udp_limit(query: Query, server_max: int) -> int:
    """Largest UDP answer the client accepts: 512 without EDNS, else its advertised size capped by ours."""
    return min(query.edns_size, server_max) if query.edns else 512
