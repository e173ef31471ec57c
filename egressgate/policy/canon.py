"""Canonical hosts, ports, paths and methods: one parser, one truth.

Every component (gateway, DNS resolver, policy engine, credential broker, audit) calls these functions
and uses only their output, so a request is decided, dialed, injected and audited under exactly one
spelling. Anything ambiguous is rejected with :class:`CanonError` (a ``ValueError`` with a short
snake_case ``.code``) rather than guessed at: for any ``str`` input, ``CanonError`` is the only exception
these functions raise, and every successful result is a fixed point (``canon(canon(x)) == canon(x)``).

Hosts (:func:`canon_host`)
--------------------------
* Case is folded and ONE trailing dot is stripped (``Example.COM.`` -> ``example.com``); a second
  trailing dot is an empty label (``empty_label``).
* U+3002, U+FF0E and U+FF61 (ideographic / full-width dots) separate labels, as in UTS #46. Non-ASCII
  input is mapped with UTS #46 (non-transitional, so ``ß`` stays ``ß``), then each label is converted to
  its IDNA2008 A-label (``xn--...``) with the ``idna`` package. Labels the IDNA2008 tables disallow
  (emoji, symbols) are rejected (``idna``) rather than mapped the way some browsers do. An ASCII label
  starting with ``xn--`` must decode to a valid U-label and re-encode to itself (``bad_punycode``).
* ASCII labels may contain ``a-z 0-9 - _``. The underscore is allowed because real DNS names carry it
  (``_dmarc``, SRV owners, legacy bucket names) and it cannot change which host a name denotes.
  Hyphens are allowed anywhere in ASCII labels (``r3---sn-x.googlevideo.com`` is real). Every other
  character, including one produced by UTS #46 mapping (full-width solidus U+FF0F, colon U+FF1A), is
  ``bad_char``. Labels longer than 63 octets are ``label_too_long``; names longer than 253 octets
  (A-label form, no trailing dot) are ``name_too_long``.
* Rejected outright: userinfo (any ``@``: ``userinfo``), C0/C1 controls including NUL/CR/LF
  (``control_char``), any whitespace (``whitespace``), any ``%`` in a name (``percent_encoded``: a
  percent-encoded host is never decoded, because a second decoder downstream could disagree), a
  ``host:port`` pair where a bare host is expected (``port_in_host``), empty input (``empty_host``).
* IP literals are recognized in every form the C library's ``inet_aton`` accepts -- 1 to 4 parts, each
  decimal, ``0``-prefixed octal or ``0x``-prefixed hex, the last part filling the remaining bytes:
  ``2130706433``, ``0177.0.0.1``, ``0x7f.1``, ``127.1``, ``0x7f000001``, ``0`` -- after UTS #46 mapping
  (so full-width digits count too), exactly as the WHATWG URL host parser does. Following WHATWG, a name
  whose last label *is a number* (all digits, or ``0x`` + hex) but which is not a valid IPv4 address is an
  error (``bad_ipv4``: ``1.2.3.999``, ``999999999999``, ``foo.123``, ``1.2.3.4.5``, ``08``), never a DNS
  name: resolvers and HTTP clients disagree on such strings. A bare ``0x`` part (WHATWG reads 0, glibc
  fails) is likewise ``bad_ipv4``. Tests check :func:`parse_inet_aton` against the C library's own
  ``inet_aton`` (``socket.inet_aton``).
* IPv6 literals are accepted bracketed (``[::1]``) or bare (``::1``, the canonical output form) and parsed
  strictly by :mod:`ipaddress` (``bad_ipv6``). Zone ids (``[fe80::1%25eth0]``, ``fe80::1%eth0``) are
  rejected (``zone_id``): a zone only qualifies link-local / multicast scopes, which egress never
  permits, and it names an interface of the gateway host rather than a destination.
* The canonical text of an IP literal is ``str(ipaddress.ip_address(...))`` as Python >= 3.13 prints
  it (:func:`ip_text`): dotted quad for IPv4, RFC 5952 compressed lower-case for IPv6, without
  brackets, IPv4-mapped addresses with a dotted tail (``::ffff:127.0.0.1``, RFC 5952 section 5).
  Python 3.12 prints mapped addresses in hex (``::ffff:7f00:1``); :func:`ip_text` pins the newer form
  so the text in audit records does not depend on the interpreter version.

Ports (:func:`canon_port`)
--------------------------
ASCII decimal digits only, ``1..65535``, no sign, no whitespace, no leading zero (``0443`` is
``port_leading_zero``: some parsers read it as octal). ``None`` means "absent" and yields ``default``
(``missing_port`` when there is none); an explicitly empty port (``host:``) is ``empty_port``.

Paths (:func:`canon_path`, :func:`split_path_query`)
----------------------------------------------------
Specified in :mod:`egressgate.policy.canon_path` (re-exported here).

Methods (:func:`canon_method`)
------------------------------
RFC 9110 ``tchar`` only, 1 to 32 characters, upper-cased (``get`` -> ``GET``, so a rule about ``DELETE``
also covers ``delete``).
"""

from __future__ import annotations

import functools
import re
from ipaddress import IPv4Address, IPv6Address

import idna

from egressgate.policy.canon_common import (
    MAX_HOST_INPUT,
    MAX_LABEL,
    MAX_METHOD,
    MAX_NAME,
    CanonError,
    reject_controls,
    require_text,
    show,
)
from egressgate.policy.canon_path import canon_path, split_path_query

__all__ = [
    "CanonError",
    "canon_host",
    "canon_method",
    "canon_path",
    "canon_port",
    "ip_text",
    "join_host_port",
    "parse_inet_aton",
    "parse_ip_literal",
    "split_host_port",
    "split_path_query",
]

IPAddress = IPv4Address | IPv6Address



# ---------------------------------------------------------------------------------------------- IPv4


def _aton_number(part: str) -> int | None:
    """One inet_aton part: decimal, 0-prefixed octal, 0x-prefixed hex (glibc: ``0x`` alone fails)."""
    if part[:2] in ("0x", "0X"):
        digits, base, allowed = part[2:], 16, "0123456789abcdefABCDEF"
    elif len(part) > 1 and part[0] == "0":
        digits, base, allowed = part[1:], 8, "01234567"
    else:
        digits, base, allowed = part, 10, "0123456789"
    if digits == "" or any(c not in allowed for c in digits):
        return None
    return int(digits, base)


def _looks_numeric(label: str) -> bool:
    """WHATWG "ends in a number": all ASCII digits, or ``0x`` followed by hex digits (or nothing: WHATWG
    reads ``0x`` as 0 where glibc fails, so such a host is rejected rather than sent to DNS)."""
    if label and all(c in "0123456789" for c in label):
        return True
    return label[:2] in ("0x", "0X") and all(c in "0123456789abcdefABCDEF" for c in label[2:])


def _aton_parts(parts: list[str]) -> IPv4Address | None:
    if not 1 <= len(parts) <= 4:
        return None
    numbers = []
    for part in parts:
        n = _aton_number(part)
        if n is None:
            return None
        numbers.append(n)
    *head, last = numbers
    if any(n > 0xFF for n in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    value = last
    for i, n in enumerate(head):
        value |= n << (8 * (3 - i))
    return IPv4Address(value)


def parse_inet_aton(text: str) -> IPv4Address | None:
    """Parse ``text`` exactly as glibc ``inet_aton`` would (no surrounding junk); None if it would fail."""
    if not isinstance(text, str) or not text or not text.isascii() or len(text) > MAX_HOST_INPUT:
        return None
    return _aton_parts(text.split("."))


# ---------------------------------------------------------------------------------------------- hosts

_FULLWIDTH_DOTS = str.maketrans({"\u3002": ".", "\uff0e": ".", "\uff61": "."})
_ASCII_LABEL = re.compile(r"[a-z0-9_-]+", re.ASCII)
_V6_CHARS = re.compile(r"[0-9A-Fa-f:.]+", re.ASCII)
_HOST_PORT = re.compile(r"[^:]*:[0-9]*", re.ASCII)


def ip_text(ip: IPAddress) -> str:
    """Canonical text of an address (see the module docstring); scope ids are dropped."""
    if isinstance(ip, IPv4Address):
        return str(ip)
    value = int(ip)
    if value >> 32 == 0xFFFF:
        return f"::ffff:{IPv4Address(value & 0xFFFFFFFF)}"
    return str(IPv6Address(value))


def _parse_v6(text: str, bracketed: bool) -> tuple[str, IPv6Address]:
    if "%" in text:
        raise CanonError(
            "zone_id",
            f"IPv6 zone ids are not accepted (they only address link-local scopes): {show(text)}",
        )
    if not bracketed and _HOST_PORT.fullmatch(text):
        raise CanonError("port_in_host", f"expected a host without a port: {show(text)}")
    if not _V6_CHARS.fullmatch(text):
        raise CanonError("bad_ipv6", f"not an IPv6 address: {show(text)}")
    try:
        ip = IPv6Address(text)
    except ValueError:
        raise CanonError("bad_ipv6", f"not an IPv6 address: {show(text)}") from None
    return ip_text(ip), ip


def _ascii_label(label: str) -> str:
    if not _ASCII_LABEL.fullmatch(label):
        bad = next((c for c in label if not _ASCII_LABEL.fullmatch(c)), label[:1])
        code = "percent_encoded" if bad == "%" else "userinfo" if bad == "@" else "bad_char"
        raise CanonError(code, f"host label {show(label)} contains {bad!r}, not allowed in host names")
    if label.startswith("xn--"):
        try:
            ok = idna.alabel(idna.ulabel(label)).decode("ascii") == label
        except Exception:  # the idna package raises several types; all mean "not a valid A-label"
            ok = False
        if not ok:
            raise CanonError("bad_punycode", f"host label {show(label)} is not a valid IDNA A-label")
    return label


def _unicode_label(label: str) -> str:
    try:
        return idna.alabel(label).decode("ascii")
    except Exception as exc:  # IDNAError, UnicodeError and friends: all mean "not IDNA2008-valid"
        raise CanonError("idna", f"host label {show(label)} is not a valid IDNA name: {exc}") from None


def _canon_host(raw: object) -> tuple[str, IPAddress | None]:
    """The shared host parser: canonical text and, for IP literals, the address."""
    return _canon_host_text(require_text(raw, "host"))


@functools.lru_cache(maxsize=8192)
def _canon_host_text(raw: str) -> tuple[str, IPAddress | None]:
    # Cached: the decision engine asks about the same few hosts on every request (p50 budget ~10 us).
    # Only successful results are cached (lru_cache does not cache exceptions); results are immutable.
    if raw == "":
        raise CanonError("empty_host", "host is empty")
    if len(raw) > MAX_HOST_INPUT:
        raise CanonError("too_long", f"host is longer than {MAX_HOST_INPUT} characters")
    reject_controls(raw, "host")
    if "@" in raw:
        raise CanonError("userinfo", f"host contains userinfo ('@'): {show(raw)}")
    if raw.startswith("["):
        if not raw.endswith("]") or len(raw) < 3:
            raise CanonError("bad_ipv6", f"unbalanced or empty brackets in host: {show(raw)}")
        return _parse_v6(raw[1:-1], bracketed=True)
    if "[" in raw or "]" in raw:
        raise CanonError("bad_char", f"brackets are only allowed around an IPv6 address: {show(raw)}")
    if ":" in raw:
        return _parse_v6(raw, bracketed=False)
    if "%" in raw:
        raise CanonError("percent_encoded", f"percent-encoded hosts are not accepted: {show(raw)}")

    name = raw.translate(_FULLWIDTH_DOTS)
    if name.isascii():
        name = name.lower()
    else:
        try:
            name = idna.uts46_remap(name, std3_rules=False, transitional=False)
        except Exception as exc:  # InvalidCodepoint etc.
            raise CanonError("idna", f"host {show(raw)} is not a valid IDNA name: {exc}") from None
    if name.endswith("."):
        name = name[:-1]
    if name == "":
        raise CanonError("empty_host", f"host has no labels: {show(raw)}")
    labels = name.split(".")
    if "" in labels:
        raise CanonError("empty_label", f"host has an empty label: {show(raw)}")

    if _looks_numeric(labels[-1]):
        ip = _aton_parts(labels) if name.isascii() else None
        if ip is None:
            raise CanonError(
                "bad_ipv4",
                f"host {show(raw)} ends in a number but is not a valid IPv4 address",
            )
        return ip_text(ip), ip

    out = [_ascii_label(label) if label.isascii() else _unicode_label(label) for label in labels]
    for label in out:
        if len(label) > MAX_LABEL:
            raise CanonError("label_too_long", f"host label longer than {MAX_LABEL} octets: {show(label)}")
    canonical = ".".join(out)
    if len(canonical) > MAX_NAME:
        raise CanonError("name_too_long", f"host name longer than {MAX_NAME} octets: {show(canonical)}")
    return canonical, None


def canon_host(raw: str) -> str:
    """Canonical host: lower-case A-label name without trailing dot, or canonical IP text (no brackets)."""
    return _canon_host(raw)[0]


def parse_ip_literal(raw: str) -> IPAddress | None:
    """The address ``raw`` denotes if it is an IP literal in any accepted spelling; None for a name.

    Raises :class:`CanonError` for input that is neither (including ``1.2.3.999``-style non-addresses).
    """
    return _canon_host(raw)[1]


# ---------------------------------------------------------------------------------------------- ports

_DIGITS = re.compile(r"[0-9]+", re.ASCII)


def canon_port(raw: str | int | None, default: int | None = None) -> int:
    """A TCP port in 1..65535 from its text (or int); ``None`` means absent and yields ``default``."""
    if raw is None:
        if default is None:
            raise CanonError("missing_port", "a port is required")
        return canon_port(default)
    if isinstance(raw, bool):
        raise CanonError("bad_port", f"port must be a number, got {raw!r}")
    if isinstance(raw, int):
        if not 1 <= raw <= 65535:
            raise CanonError("port_out_of_range", f"port {raw} is outside 1..65535")
        return raw
    raw = require_text(raw, "port")
    if raw == "":
        raise CanonError("empty_port", "port is empty")
    if not _DIGITS.fullmatch(raw):
        raise CanonError("bad_port", f"port must be decimal digits only: {show(raw)}")
    if len(raw) > 1 and raw[0] == "0":
        raise CanonError("port_leading_zero", f"port has a leading zero: {show(raw)}")
    if len(raw) > 5 or not 1 <= int(raw) <= 65535:
        raise CanonError("port_out_of_range", f"port {show(raw)} is outside 1..65535")
    return int(raw)


def split_host_port(authority: str, default_port: int | None = None) -> tuple[str, int]:
    """Split an authority (``host``, ``host:port``, ``[v6]:port``) into canonical host and port.

    Userinfo is rejected, never stripped: ``allowed.com@evil.com`` must not be read two ways.
    """
    authority = require_text(authority, "authority")
    if len(authority) > MAX_HOST_INPUT + 8:
        raise CanonError("too_long", "authority is too long")
    reject_controls(authority, "authority")
    if "@" in authority:
        raise CanonError("userinfo", f"authority contains userinfo ('@'): {show(authority)}")
    port_text: str | None
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise CanonError("bad_ipv6", f"unbalanced brackets in authority: {show(authority)}")
        host, rest = authority[: end + 1], authority[end + 1 :]
        if rest == "":
            port_text = None
        elif rest.startswith(":"):
            port_text = rest[1:]
        else:
            raise CanonError("bad_authority", f"unexpected text after ']': {show(authority)}")
    else:
        colons = authority.count(":")
        if colons == 0:
            host, port_text = authority, None
        elif colons == 1:
            host, port_text = authority.split(":")
        else:
            raise CanonError("unbracketed_ipv6", f"an IPv6 address in an authority needs brackets: {show(authority)}")
    if host == "":
        raise CanonError("empty_host", f"authority has no host: {show(authority)}")
    return canon_host(host), canon_port(port_text, default_port)


def join_host_port(host: str, port: int) -> str:
    """Inverse of :func:`split_host_port` for canonical values (brackets IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -------------------------------------------------------------------------------------------- methods

_TCHAR = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+", re.ASCII)


def canon_method(raw: str) -> str:
    """An HTTP method: RFC 9110 token characters only, upper-cased."""
    raw = require_text(raw, "method")
    if raw == "":
        raise CanonError("empty_method", "method is empty")
    if len(raw) > MAX_METHOD:
        raise CanonError("too_long", f"method is longer than {MAX_METHOD} characters")
    if not _TCHAR.fullmatch(raw):
        raise CanonError("bad_method", f"method contains characters outside RFC 9110 tchar: {show(raw)}")
    return raw.upper()
