"""What a TLS ClientHello (and the server's first answer) says, for passthrough routes (passthrough.py).

Pure parsing, no I/O. `check_hello` is the passthrough route's whole check of a ClientHello: exactly one
host_name in clear, canonically equal to the CONNECT host (an IP-literal target may send none), no
Encrypted ClientHello. The SNI is read here rather than with mitmproxy's `ClientHello.sni`, which skips a
malformed server_name extension and takes the first good one: a server that reads another would be
fronted. `server_hello_kind` tells a TLS 1.3 HelloRetryRequest from a ServerHello: after a retry the
client sends a *second* ClientHello in clear, and OpenSSL servers act on its SNI again (seen: the server's
servername callback runs for both), so that one is checked exactly like the first.
"""

from __future__ import annotations

import struct

from mitmproxy.tls import ClientHello

from egressgate.gateway.layers.tls_limits import HelloScan
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.policy.canon import CanonError, canon_host, parse_ip_literal
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason

ALERT_ACCESS_DENIED = b"\x15\x03\x03\x00\x02\x02\x31"  # fatal access_denied (RFC 8446 6.2), in clear
SERVER_NAME = 0x0000
# Encrypted ClientHello (RFC 9849) and its draft predecessor ESNI: the real name is not in clear.
ENCRYPTED_NAME = {0xFE0D: "encrypted_client_hello", 0xFFCE: "encrypted_server_name"}


def _mismatch(host: str, what: str, detail: str) -> Decision:
    return gateway_deny(
        Reason.HOST_MISMATCH,
        f"This tunnel is a TLS passthrough route to {host}; its ClientHello must carry exactly one SNI "
        f"naming {host} ({what}). Connect with SNI {host}, or open a new CONNECT for another host.",
        detail=detail,
    )


def server_names(body: bytes) -> list[tuple[int, bytes]] | None:
    """The (name_type, name) entries of a server_name extension body (RFC 6066 3); None if malformed."""
    if len(body) < 2 or struct.unpack("!H", body[:2])[0] != len(body) - 2:
        return None
    out, i = [], 2
    while i < len(body):
        if i + 3 > len(body):
            return None
        kind, size = body[i], struct.unpack("!H", body[i + 1:i + 3])[0]
        if i + 3 + size > len(body):
            return None
        out.append((kind, body[i + 3:i + 3 + size]))
        i += 3 + size
    return out


def read_sni(hello: bytes) -> tuple[str | None, str | None]:
    """(SNI, None) for handshake message `hello` carrying exactly one host_name in clear; (None or the raw
    name, problem) otherwise. Parsed here, not with mitmproxy's `ClientHello.sni`, which skips a
    malformed server_name and takes the first good one: a server that reads another would be fronted."""
    if not hello or hello[0] != 1:
        return None, "not_client_hello"
    try:
        extensions = ClientHello(hello[4:]).extensions
    except Exception:  # kaitai raises EOFError, ValueError, its own errors... all mean "not parseable"
        return None, "client_hello_unparseable"
    for kind, _ in extensions:
        if kind in ENCRYPTED_NAME:
            return None, ENCRYPTED_NAME[kind]
    bodies = [bytes(body) for kind, body in extensions if kind == SERVER_NAME]
    if not bodies:
        return None, "sni_missing"
    names = server_names(bodies[0]) if len(bodies) == 1 else None
    if names is None or len(names) != 1 or names[0][0] != 0:
        return None, "sni_ambiguous"
    try:
        return names[0][1].decode("ascii"), None
    except UnicodeDecodeError:
        return names[0][1].decode("latin-1")[:255], "sni_invalid"


def check_hello(hello: bytes, host: str) -> tuple[str | None, Decision | None]:
    """(the SNI, None) when handshake message `hello` is a ClientHello naming `host` (canonical) exactly
    once in clear; (the SNI or None, the deny) otherwise."""
    sni, problem = read_sni(hello)
    if problem == "not_client_hello":
        return None, gateway_deny(Reason.PROTOCOL_NOT_ALLOWED, f"A passthrough route to {host} carries TLS "
                                  "only; the first handshake message was not a ClientHello.", detail=problem)
    if problem == "client_hello_unparseable":
        return None, gateway_deny(Reason.INVALID_REQUEST, "The TLS ClientHello could not be parsed.", detail=problem)
    if problem in ENCRYPTED_NAME.values():
        return None, gateway_deny(
            Reason.PROTOCOL_NOT_ALLOWED,
            f"Encrypted ClientHello hides the server name; a passthrough route to {host} needs the SNI "
            f"in clear. Turn ECH off for this client.", detail=problem)
    if problem == "sni_missing":
        if parse_ip_literal(host) is not None:
            return None, None  # an IP-literal target: clients send no SNI (RFC 6066 3), the pin is the check
        return None, _mismatch(host, "it sent none", problem)
    if problem == "sni_ambiguous":
        return None, _mismatch(host, "it sent several or a malformed one", problem)
    assert sni is not None
    try:
        same = problem is None and canon_host(sni) == host
    except CanonError:
        same, problem = False, "sni_invalid"
    if problem is not None:
        return sni, _mismatch(host, "its SNI is not a valid name", problem)
    if not same:
        return sni, _mismatch(host, f"it named {sni[:255]}", "sni_mismatch")
    return sni, None


# ServerHello.random of a HelloRetryRequest: SHA-256("HelloRetryRequest") (RFC 8446 4.1.3)
HRR_RANDOM = bytes.fromhex("CF21AD74E59A6111BE1D8C021E65B891C2A211167ABB8C5E079E09E2C8A8339C")
_HELLO_PREFIX = 4 + 2 + 32  # handshake header, legacy_version, random


def server_hello_kind(scan: HelloScan, buf: bytearray) -> str | None:
    """`hrr` when the server's first handshake message (records in `buf`, the server's bytes from the
    start; `scan` resumes across calls) is a HelloRetryRequest, `other` for anything else (a ServerHello,
    an alert, not TLS), None until enough of it has arrived to tell."""
    scan.feed(buf)
    if scan.invalid:
        return "other"
    if len(scan.hello) >= _HELLO_PREFIX:
        hello = scan.hello
        return "hrr" if hello[0] == 2 and bytes(hello[6:_HELLO_PREFIX]) == HRR_RANDOM else "other"
    return "other" if scan.complete else None
