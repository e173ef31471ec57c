"""The answer for a name the policy does not allow, when the policy says `network.dns.deny_answer: gateway`.

Why: a sandbox whose TCP is redirected to the gateway (transparent mode) that gets NXDOMAIN for a denied name
prints "could not resolve host" (npm retries for ~70 s first); the agent never learns that policy refused it
or that it could ask for approval. Answering the name with the gateway's own address instead sends the
client's HTTP(S) request to the transparent listener, which decides the name again (TLS SNI or Host) and
answers with the deny body over the gateway's TLS: the reason, the rule and the approval id.

What it never does: ask anyone. The answer is synthesised here from the query and one address; the name
never leaves the gateway (no DNS exfiltration; tests/escape/test_readable_dns.py watches a DNS canary).
The original destination a transparent client dials is never dialed either (transparent.py), so the address
only has to route the connection to the gateway: the host end of the sandbox's /30 link (runtimes/
addressing.py: host .1, sandbox .2 of each slot), where its default route, resolver and proxy already are.

Only A queries get a record (sandbox links are IPv4 only); any other type of a denied name gets an empty
NOERROR answer (NODATA), so a client falls back to its A answer. The TTL is short: a name the operator then
allows or approves works at once anyway (the transparent listener decides by name, not by address).
"""

from __future__ import annotations

import ipaddress
import struct

from dnslib import QTYPE

from egressgate.dns.wire import CD, HEADER, NOERROR, QR, RA, RD, Query

TTL = 10
QTYPE_A = int(QTYPE.A)
_RR = struct.Struct("!HHHIH")  # name pointer, type, class, ttl, rdlength
_NAME_AT_QUESTION = 0xC000 | HEADER.size  # compression pointer to the question's name (offset 12)


def link_peer(client: str) -> str | None:
    """The host end of the /30 the IPv4 `client` sits in (its runtime's host_ip), or None when the client
    is that end itself or not IPv4 (no address to point it at: the rcode answer is used instead)."""
    try:
        address = ipaddress.IPv4Address(client)
    except ValueError:
        return None
    peer = (int(address) & ~3) + 1
    return None if peer == int(address) else str(ipaddress.IPv4Address(peer))


def answer_address(setting: str | None, client: str, networks: tuple[str, ...] = ()) -> str | None:
    """Where a denied name points for `client`: the configured IPv4, the link peer ("auto"), or None
    (off, or no usable address: the policy's deny rcode is answered). "auto" holds only for clients in
    `networks` (the runtime's address pool, where every sandbox sits on a /30 whose host end is the
    gateway; empty: any client): elsewhere the peer of a /30 could be some other machine."""
    if setting is None:
        return None
    if setting == "auto":
        if networks and not _inside(client, networks):
            return None
        return link_peer(client)
    return setting


def _inside(client: str, networks: tuple[str, ...]) -> bool:
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return False
    return any(address in ipaddress.ip_network(net, strict=False) for net in networks)


def pack(query: Query, opt: bytes, address: str) -> bytes:
    """NOERROR with one A record (`address`) for an A query, none (NODATA) for any other type; the question
    echoed verbatim, RD and CD echoed, OPT appended when the query had EDNS."""
    flags = QR | RA | (query.flags & (RD | CD)) | NOERROR
    records = b""
    if query.qtype == QTYPE_A:
        records = _RR.pack(_NAME_AT_QUESTION, QTYPE_A, 1, TTL, 4) + ipaddress.IPv4Address(address).packed
    head = HEADER.pack(query.id, flags, 1, 1 if records else 0, 0, 1 if opt else 0)
    return head + query.question + records + opt
