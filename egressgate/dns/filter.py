"""The answer filter: what an upstream answer may carry back into a sandbox.

Rebinding defence. An allowed name must never resolve to an address the gateway would refuse to dial
(loopback, RFC 1918, CGNAT, link-local, metadata, ULA, IPv4 embedded in IPv6, ...), because the sandbox could
then reach it through some path that does not re-check (a second resolver, a cached address, a raw socket).
So every A/AAAA record is classified with the same `policy/addr.py` code the gateway uses.

Shape rules (why records are dropped that are not addresses):
- Only records on the CNAME chain that starts at the question name are kept; anything else in the answer
  section (another owner, DNAME, RRSIG, stray types) is an injection surface and is removed. The authority
  section keeps only SOA (needed for negative caching by the client); the additional section is never passed
  on.
- HTTPS/SVCB records lose their `ipv4hint`/`ipv6hint` parameters entirely (a client may connect to a hint
  before it has A/AAAA answers, so hints would bypass the address check). A record whose `mandatory` list
  names a hint, or whose target name cannot be re-packed, is removed as a whole. dnslib 0.9.26 parses HTTPS
  (type 65) into (key, value) pairs and re-packs them byte-exactly; SVCB (type 64) has the same wire format
  and is parsed with the same class here.
- If filtering removed something and no record of the asked type is left, the answer is "emptied": the caller
  answers with the policy's deny rcode (NXDOMAIN by default) instead of an empty NOERROR, so the client fails
  fast instead of retrying another family.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from dnslib import HTTPS, RD, RR, Buffer, DNSLabel

from egressgate.policy.addr import check_address

T_A, T_CNAME, T_SOA, T_AAAA, T_SVCB, T_HTTPS, T_ANY = 1, 5, 6, 28, 64, 65, 255
CLASS_IN = 1
MAX_CHAIN = 16  # CNAME hops we follow; longer chains are cut (and the answer is then emptied)
_HINT_KEYS = (4, 6)  # ipv4hint, ipv6hint
_MANDATORY = 0


@dataclass(frozen=True, slots=True)
class Filtered:
    answers: tuple[RR, ...]
    authority: tuple[RR, ...]
    stripped: int  # records removed
    emptied: bool  # something was removed and nothing of the asked type is left
    addresses: tuple[str, ...]  # A/AAAA values kept (for the audit record)
    refused: tuple[str, ...] = ()  # A/AAAA values the address check removed (recorded when it empties the answer)


def name_key(label: DNSLabel) -> tuple[bytes, ...]:
    """Case-insensitive identity of a domain name (DNS compares names ASCII-case-insensitively)."""
    return tuple(part.lower() for part in label.label)


def sanitize_svcb(rr: RR) -> RR | None:
    """A copy of an HTTPS/SVCB record without address hints, or None when it cannot be made safe."""
    try:
        if isinstance(rr.rdata, HTTPS):
            priority, target, params = rr.rdata.priority, rr.rdata.target, rr.rdata.params
        else:
            raw = bytes(rr.rdata.data)
            parsed = HTTPS.parse(Buffer(raw), len(raw))
            priority, target, params = parsed.priority, parsed.target, parsed.params
        if sum(len(label) + 1 for label in target) + 1 > 255 or any(not 0 < len(x) < 64 for x in target):
            return None
        kept = []
        for key, value in params:
            if key == _MANDATORY and any(
                int.from_bytes(value[i : i + 2], "big") in _HINT_KEYS for i in range(0, len(value), 2)
            ):
                return None
            if key not in _HINT_KEYS:
                kept.append((key, bytes(value)))
        clean = HTTPS(priority, list(target), kept)
        if rr.rtype == T_SVCB:
            buffer = Buffer()
            clean.pack(buffer)
            rdata: RD = RD(bytes(buffer.data))
        else:
            rdata = clean
        return RR(rr.rname, rr.rtype, rr.rclass, rr.ttl, rdata)
    except Exception:
        # Any parse or pack problem: the record is not passed on. Never let a crafted record crash a query.
        return None


def record_address(rr: RR) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address of an A/AAAA record whose rdata has exactly the right length, else None."""
    data = rr.rdata.data if hasattr(rr.rdata, "data") else None
    if data is None:
        return None
    raw = bytes(data)
    if (rr.rtype == T_A and len(raw) == 4) or (rr.rtype == T_AAAA and len(raw) == 16):
        return ipaddress.ip_address(raw)
    return None


def cname_chain(qname: DNSLabel, answers: Sequence[RR]) -> tuple[set[tuple[bytes, ...]], set[int]]:
    """(owner names on the CNAME chain that starts at `qname`, ids of the CNAME records forming it).

    The one rule for "which records of an answer belong to the question", shared by the answer filter
    and the gateway's own lookups (gateway/service/resolver.py): a record owned by any other name is ignored."""
    by_owner: dict[tuple[bytes, ...], RR] = {}
    for rr in answers:
        if rr.rtype == T_CNAME and rr.rclass == CLASS_IN:
            by_owner.setdefault(name_key(rr.rname), rr)
    chain = [name_key(qname)]
    cnames: set[int] = set()
    while len(chain) <= MAX_CHAIN:
        rr = by_owner.get(chain[-1])
        if rr is None:
            break
        target = name_key(rr.rdata.label)
        cnames.add(id(rr))
        if target in chain:  # loop: keep what we have, the terminal type will be missing
            break
        chain.append(target)
    return set(chain), cnames


def filter_answer(
    qname: DNSLabel,
    qtype: int,
    answers: Sequence[RR],
    authority: Sequence[RR],
    allow_private: tuple,
) -> Filtered:
    """Apply the shape rules and the address check (see the module docstring). Pure; never raises on
    content it does not like, it removes it."""
    on_chain, cnames = cname_chain(qname, answers)

    kept: list[RR] = []
    addresses: list[str] = []
    refused: list[str] = []
    stripped = 0
    for rr in answers:
        owner = name_key(rr.rname)
        if rr.rclass != CLASS_IN or owner not in on_chain:
            stripped += 1
            continue
        if rr.rtype == T_CNAME:
            if id(rr) in cnames:
                kept.append(rr)
            else:
                stripped += 1
            continue
        if rr.rtype != qtype and qtype != T_ANY:
            stripped += 1
            continue
        if rr.rtype in (T_A, T_AAAA):
            ip = record_address(rr)
            if ip is None or check_address(ip, allow_private) is not None:
                stripped += 1
                if ip is not None:
                    refused.append(str(ip))
                continue
            addresses.append(str(ip))
            kept.append(rr)
        elif rr.rtype in (T_HTTPS, T_SVCB):
            clean = sanitize_svcb(rr)
            if clean is None:
                stripped += 1
                continue
            kept.append(clean)
        else:
            kept.append(rr)
    has_asked = any(rr.rtype == qtype or (qtype == T_ANY and rr.rtype != T_CNAME) for rr in kept)
    emptied = stripped > 0 and not has_asked  # only answer-section removals empty an answer
    soa = tuple(rr for rr in authority if rr.rtype == T_SOA and rr.rclass == CLASS_IN)
    stripped += len(authority) - len(soa)
    return Filtered(tuple(kept), soa, stripped, emptied, tuple(addresses), tuple(refused))
