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
* Input is an origin-form request target: it must start with ``/`` (``not_origin_form``; ``*`` and
  absolute-form are the caller's business). The empty path becomes ``/`` (RFC 9110 4.2.3 / RFC 3986
  6.2.3). The query is split off and dropped by :func:`canon_path`; :func:`split_path_query` returns it
  verbatim (without ``?``; ``""`` when absent). A fragment (``#``) is never sent by a conforming client
  and is rejected (``fragment``).
* Percent-encodings of unreserved characters (``A-Z a-z 0-9 - . _ ~``) are decoded (``%41`` -> ``A``,
  ``%2e`` -> ``.``, ``%7E`` -> ``~``); every other escape is kept and upper-cased (``%2f`` -> ``%2F``).
  Malformed escapes are ``bad_percent``; ``%00`` is ``nul``. Nothing is decoded twice (``/a%252eb`` stays).
* ``%2F`` and ``%5C`` stay encoded and are distinct from ``/`` and ``\\`` (RFC 3986: reserved characters'
  escapes are not equivalent to the characters). A raw backslash is rejected (``backslash``): servers
  disagree on whether it separates segments.
* Raw characters that RFC 3986 does not allow in a path (``" < > [ ] ^ ` { | }``) and non-ASCII characters
  (as UTF-8; ``surrogateescape`` recovers raw bytes) are percent-encoded, so ``/a|b`` and ``/a%7Cb`` are
  one path. Controls, NUL/CR/LF, spaces and other whitespace anywhere in the target are rejected
  (``control_char`` / ``whitespace``).
* Dot segments are removed per RFC 3986 5.2.4 *after* that decoding, so ``%2e%2e`` is a dot segment;
  ``..`` above the root clamps at ``/``.
* Consecutive slashes are kept (``/a//b`` stays): matching treats them literally, so a rule for
  ``/a/b`` does not match ``/a//b`` (fails closed). The one place where keeping them is ambiguous is a
  ``..`` that would remove an empty segment: ``/a//../b`` is ``/a/b`` by RFC 3986 but ``/b`` to a
  server that merges slashes before resolving dot segments (nginx by default), so it is rejected
  (``ambiguous_traversal``).
* Traversal spellings that survive RFC 3986 normalization but that real servers resolve are rejected
  rather than normalized: a dot segment with path parameters (``/..;/admin``, Tomcat-style:
  ``dot_segment_param``); a dot segment that appears once the segment is percent-decoded once or twice
  -- behind an encoded separator or parameter delimiter (``/files/..%2Fadmin``, ``/a/.%5Cb``,
  ``/%2e%2e%3B/x``) or double-encoded (``/%252e%252e/x``) (``encoded_traversal``); and overlong UTF-8
  (``%C0%AE``: ``overlong_utf8``). A ``*`` glob segment can therefore never match a segment a server
  would read as ``..``.

Methods (:func:`canon_method`)
------------------------------
RFC 9110 ``tchar`` only, 1 to 32 characters, upper-cased (``get`` -> ``GET``, so a rule about ``DELETE``
also covers ``delete``).
"""

from __future__ import annotations

import functools
import re
from ipaddress import IPv4Address, IPv6Address
from urllib.parse import unquote

import idna

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

MAX_HOST_INPUT = 1024
"""Longest raw host accepted (before mapping); longer input is ``too_long`` without further work."""
MAX_PATH_INPUT = 65536
"""Longest raw request target accepted."""
MAX_METHOD = 32
MAX_LABEL = 63
MAX_NAME = 253


class CanonError(ValueError):
    """Input that has no single canonical meaning. ``code`` is a stable snake_case identifier."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"CanonError({self.code!r}, {self.message!r})"

    def __reduce__(self) -> tuple[type[CanonError], tuple[str, str]]:
        return (CanonError, (self.code, self.message))  # picklable despite the two-argument __init__


def _show(raw: str) -> str:
    """A short, escaped rendering of untrusted input for error messages."""
    return repr(raw[:60] + ("..." if len(raw) > 60 else ""))


def _require_text(raw: object, what: str) -> str:
    if not isinstance(raw, str):
        raise CanonError("not_text", f"{what} must be text, got {type(raw).__name__}")
    return raw


# C0/C1 controls, DEL, and every character str.isspace() or Unicode Zs/Zl/Zp calls whitespace.
_FORBIDDEN = re.compile("[\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")


def _reject_controls(raw: str, what: str) -> None:
    """Reject C0/C1 controls and every kind of whitespace (they split or smuggle in other parsers)."""
    found = _FORBIDDEN.search(raw)
    if found is None:
        return
    o = ord(found.group())
    if o < 0x20 or 0x7F <= o < 0xA0:
        raise CanonError("control_char", f"{what} contains control character U+{o:04X}: {_show(raw)}")
    raise CanonError("whitespace", f"{what} contains whitespace U+{o:04X}: {_show(raw)}")


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
            f"IPv6 zone ids are not accepted (they only address link-local scopes): {_show(text)}",
        )
    if not bracketed and _HOST_PORT.fullmatch(text):
        raise CanonError("port_in_host", f"expected a host without a port: {_show(text)}")
    if not _V6_CHARS.fullmatch(text):
        raise CanonError("bad_ipv6", f"not an IPv6 address: {_show(text)}")
    try:
        ip = IPv6Address(text)
    except ValueError:
        raise CanonError("bad_ipv6", f"not an IPv6 address: {_show(text)}") from None
    return ip_text(ip), ip


def _ascii_label(label: str) -> str:
    if not _ASCII_LABEL.fullmatch(label):
        bad = next((c for c in label if not _ASCII_LABEL.fullmatch(c)), label[:1])
        code = "percent_encoded" if bad == "%" else "userinfo" if bad == "@" else "bad_char"
        raise CanonError(code, f"host label {_show(label)} contains {bad!r}, not allowed in host names")
    if label.startswith("xn--"):
        try:
            ok = idna.alabel(idna.ulabel(label)).decode("ascii") == label
        except Exception:  # the idna package raises several types; all mean "not a valid A-label"
            ok = False
        if not ok:
            raise CanonError("bad_punycode", f"host label {_show(label)} is not a valid IDNA A-label")
    return label


def _unicode_label(label: str) -> str:
    try:
        return idna.alabel(label).decode("ascii")
    except Exception as exc:  # IDNAError, UnicodeError and friends: all mean "not IDNA2008-valid"
        raise CanonError("idna", f"host label {_show(label)} is not a valid IDNA name: {exc}") from None


def _canon_host(raw: object) -> tuple[str, IPAddress | None]:
    """The shared host parser: canonical text and, for IP literals, the address."""
    return _canon_host_text(_require_text(raw, "host"))


@functools.lru_cache(maxsize=8192)
def _canon_host_text(raw: str) -> tuple[str, IPAddress | None]:
    # Cached: the decision engine asks about the same few hosts on every request (p50 budget ~10 us).
    # Only successful results are cached (lru_cache does not cache exceptions); results are immutable.
    if raw == "":
        raise CanonError("empty_host", "host is empty")
    if len(raw) > MAX_HOST_INPUT:
        raise CanonError("too_long", f"host is longer than {MAX_HOST_INPUT} characters")
    _reject_controls(raw, "host")
    if "@" in raw:
        raise CanonError("userinfo", f"host contains userinfo ('@'): {_show(raw)}")
    if raw.startswith("["):
        if not raw.endswith("]") or len(raw) < 3:
            raise CanonError("bad_ipv6", f"unbalanced or empty brackets in host: {_show(raw)}")
        return _parse_v6(raw[1:-1], bracketed=True)
    if "[" in raw or "]" in raw:
        raise CanonError("bad_char", f"brackets are only allowed around an IPv6 address: {_show(raw)}")
    if ":" in raw:
        return _parse_v6(raw, bracketed=False)
    if "%" in raw:
        raise CanonError("percent_encoded", f"percent-encoded hosts are not accepted: {_show(raw)}")

    name = raw.translate(_FULLWIDTH_DOTS)
    if name.isascii():
        name = name.lower()
    else:
        try:
            name = idna.uts46_remap(name, std3_rules=False, transitional=False)
        except Exception as exc:  # InvalidCodepoint etc.
            raise CanonError("idna", f"host {_show(raw)} is not a valid IDNA name: {exc}") from None
    if name.endswith("."):
        name = name[:-1]
    if name == "":
        raise CanonError("empty_host", f"host has no labels: {_show(raw)}")
    labels = name.split(".")
    if "" in labels:
        raise CanonError("empty_label", f"host has an empty label: {_show(raw)}")

    if _looks_numeric(labels[-1]):
        ip = _aton_parts(labels) if name.isascii() else None
        if ip is None:
            raise CanonError(
                "bad_ipv4",
                f"host {_show(raw)} ends in a number but is not a valid IPv4 address",
            )
        return ip_text(ip), ip

    out = [_ascii_label(label) if label.isascii() else _unicode_label(label) for label in labels]
    for label in out:
        if len(label) > MAX_LABEL:
            raise CanonError("label_too_long", f"host label longer than {MAX_LABEL} octets: {_show(label)}")
    canonical = ".".join(out)
    if len(canonical) > MAX_NAME:
        raise CanonError("name_too_long", f"host name longer than {MAX_NAME} octets: {_show(canonical)}")
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
    raw = _require_text(raw, "port")
    if raw == "":
        raise CanonError("empty_port", "port is empty")
    if not _DIGITS.fullmatch(raw):
        raise CanonError("bad_port", f"port must be decimal digits only: {_show(raw)}")
    if len(raw) > 1 and raw[0] == "0":
        raise CanonError("port_leading_zero", f"port has a leading zero: {_show(raw)}")
    if len(raw) > 5 or not 1 <= int(raw) <= 65535:
        raise CanonError("port_out_of_range", f"port {_show(raw)} is outside 1..65535")
    return int(raw)


def split_host_port(authority: str, default_port: int | None = None) -> tuple[str, int]:
    """Split an authority (``host``, ``host:port``, ``[v6]:port``) into canonical host and port.

    Userinfo is rejected, never stripped: ``allowed.com@evil.com`` must not be read two ways.
    """
    authority = _require_text(authority, "authority")
    if len(authority) > MAX_HOST_INPUT + 8:
        raise CanonError("too_long", "authority is too long")
    _reject_controls(authority, "authority")
    if "@" in authority:
        raise CanonError("userinfo", f"authority contains userinfo ('@'): {_show(authority)}")
    port_text: str | None
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise CanonError("bad_ipv6", f"unbalanced brackets in authority: {_show(authority)}")
        host, rest = authority[: end + 1], authority[end + 1 :]
        if rest == "":
            port_text = None
        elif rest.startswith(":"):
            port_text = rest[1:]
        else:
            raise CanonError("bad_authority", f"unexpected text after ']': {_show(authority)}")
    else:
        colons = authority.count(":")
        if colons == 0:
            host, port_text = authority, None
        elif colons == 1:
            host, port_text = authority.split(":")
        else:
            raise CanonError("unbracketed_ipv6", f"an IPv6 address in an authority needs brackets: {_show(authority)}")
    if host == "":
        raise CanonError("empty_host", f"authority has no host: {_show(authority)}")
    return canon_host(host), canon_port(port_text, default_port)


def join_host_port(host: str, port: int) -> str:
    """Inverse of :func:`split_host_port` for canonical values (brackets IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------------------------------------- paths

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
# pchar minus unreserved and '%', plus '/': characters allowed raw in an RFC 3986 path.
_RAW_OK = _UNRESERVED | frozenset(b"!$&'()*+,;=:@/")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_PLAIN_PATH = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/]*", re.ASCII)
_SEPARATORS = re.compile(r"[/\\]")
# Overlong UTF-8 (C0/C1 leads, E0 80-9F, F0 80-8F): never valid, decoded to '.' or '/' by lax decoders.
_OVERLONG = re.compile(r"%C[01]%[89AB][0-9A-F]|%E0%[89][0-9A-F]|%F0%8[0-9A-F]")


def _normalize_escapes(path: str) -> str:
    if _PLAIN_PATH.fullmatch(path):  # the common case: nothing to decode or encode
        return path
    try:
        data = path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise CanonError("bad_char", f"path contains an unencodable character: {_show(path)}") from None
    out: list[str] = []
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        if b == 0x25:  # '%'
            if i + 2 >= n:
                raise CanonError("bad_percent", f"truncated percent-escape in path: {_show(path)}")
            h1, h2 = data[i + 1], data[i + 2]
            if h1 not in _HEX or h2 not in _HEX:
                raise CanonError("bad_percent", f"malformed percent-escape in path: {_show(path)}")
            value = int(bytes((h1, h2)), 16)
            if value == 0:
                raise CanonError("nul", f"path contains an encoded NUL (%00): {_show(path)}")
            out.append(chr(value) if value in _UNRESERVED else f"%{value:02X}")
            i += 3
        elif b in _RAW_OK:
            out.append(chr(b))
            i += 1
        else:
            out.append(f"%{b:02X}")
            i += 1
    return "".join(out)


def _is_dot(piece: str) -> bool:
    return piece in (".", "..")


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 5.2.4 for a path starting with '/': '..' above the root clamps at '/'."""
    if "/." not in path:  # every dot segment follows a '/'
        return path
    segments = path.split("/")[1:]
    out: list[str] = []
    last = len(segments) - 1
    for i, seg in enumerate(segments):
        if seg == ".":
            if i == last:
                out.append("")
        elif seg == "..":
            if out and out[-1] == "":
                # '/a//../b' is '/a/b' by RFC 3986 but '/b' to servers that merge slashes first (nginx).
                raise CanonError("ambiguous_traversal", f"'..' after an empty segment in path: {_show(path)}")
            if out:
                out.pop()
            if i == last:
                out.append("")
        else:
            out.append(seg)
    return "/" + "/".join(out)


def _dot_after_params(piece: str) -> bool:
    """Whether ``piece`` is a dot segment once path parameters (``;...``) are stripped."""
    return _is_dot(piece.split(";", 1)[0])


def _check_hidden_traversal(path: str) -> None:
    """Reject dot segments that only appear to a server that strips parameters or decodes again."""
    if _OVERLONG.search(path):
        raise CanonError("overlong_utf8", f"path contains an overlong UTF-8 encoding: {_show(path)}")
    for seg in path.split("/"):
        if _is_dot(seg) or ("%" not in seg and ";" not in seg):
            continue
        if _dot_after_params(seg):
            raise CanonError("dot_segment_param", f"dot segment with parameters in path: {_show(path)}")
        view = seg
        for _ in range(2):  # decoded once (%2F, %5C, %3B), decoded twice (%252e...)
            if "%" not in view:
                break
            view = unquote(view, errors="surrogateescape")
            if any(_dot_after_params(piece) for piece in _SEPARATORS.split(view)):
                raise CanonError(
                    "encoded_traversal",
                    f"dot segment behind an encoded '/', '\\' or ';', or double-encoded, in path: {_show(path)}",
                )


def split_path_query(raw: str) -> tuple[str, str]:
    """Canonical path and the raw query (without '?'; ``""`` when absent) of an origin-form target."""
    raw = _require_text(raw, "path")
    if len(raw) > MAX_PATH_INPUT:
        raise CanonError("too_long", f"request target is longer than {MAX_PATH_INPUT} characters")
    _reject_controls(raw, "request target")
    if "#" in raw:
        raise CanonError("fragment", f"request target contains a fragment ('#'): {_show(raw)}")
    path, _, query = raw.partition("?")
    if path == "":
        path = "/"
    if not path.startswith("/"):
        raise CanonError("not_origin_form", f"path must start with '/': {_show(raw)}")
    if "\\" in path:
        raise CanonError("backslash", f"path contains a raw backslash: {_show(raw)}")
    normalized = _normalize_escapes(path)
    _check_hidden_traversal(normalized)
    return _remove_dot_segments(normalized), query


def canon_path(raw: str) -> str:
    """Canonical origin-form path (query dropped); see the module docstring for every rule."""
    return split_path_query(raw)[0]


# -------------------------------------------------------------------------------------------- methods

_TCHAR = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+", re.ASCII)


def canon_method(raw: str) -> str:
    """An HTTP method: RFC 9110 token characters only, upper-cased."""
    raw = _require_text(raw, "method")
    if raw == "":
        raise CanonError("empty_method", "method is empty")
    if len(raw) > MAX_METHOD:
        raise CanonError("too_long", f"method is longer than {MAX_METHOD} characters")
    if not _TCHAR.fullmatch(raw):
        raise CanonError("bad_method", f"method contains characters outside RFC 9110 tchar: {_show(raw)}")
    return raw.upper()
