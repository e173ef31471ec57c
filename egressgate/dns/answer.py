"""Packing allowed answers (the records that survived the filter) into wire bytes."""

from __future__ import annotations

import struct
import time

from dnslib import EDNS0, RR, DNSHeader, DNSLabel, DNSQuestion, DNSRecord

from egressgate.dns.cache import CacheEntry
from egressgate.dns.filter import Filtered
from egressgate.dns.wire import CD, HEADER, QR, RA, RD, Query


def pack_answer(entry: CacheEntry, filtered: Filtered, query: Query, key: object, edns_size: int) -> bytes:
    """The answer bytes. Packing with dnslib costs more than everything else on the cached path, so the
    packed answer is memoised per cache entry, per filtered view and per EDNS presence, and re-packed
    when the remaining TTL (whole seconds) changes. The memo holds the canonical (lower-case) question;
    the client's id, flags and name spelling (same length: the name differs only in case, the resolver
    made sure) are patched in, so compression pointers stay valid."""
    remaining = entry.remaining(time.monotonic())
    rcode = entry.answer.rcode
    memo = entry.packed.get(key)
    if memo is None or memo[0] != remaining:
        reply = DNSRecord(
            DNSHeader(id=0, bitmap=QR | RA | rcode),
            questions=[DNSQuestion(DNSLabel(tuple(x.lower() for x in query.labels)), query.qtype, query.qclass)],
            rr=[RR(r.rname, r.rtype, r.rclass, min(r.ttl, remaining), r.rdata) for r in filtered.answers],
            auth=[RR(r.rname, r.rtype, r.rclass, min(r.ttl, remaining), r.rdata) for r in filtered.authority],
            ar=[EDNS0(udp_len=edns_size)] if query.edns else [],
        )
        memo = (remaining, reply.pack())
        entry.packed[key] = memo
    template = memo[1]
    name_end = HEADER.size + len(query.question) - 4
    flags = QR | RA | (query.flags & (RD | CD)) | rcode
    return struct.pack("!HH", query.id, flags) + template[4 : HEADER.size] + query.question[:-4] + template[name_end:]
