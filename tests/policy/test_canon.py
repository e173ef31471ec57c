"""Canonicalization tables and properties (egressgate.policy.canon).

Every bypass spelling we know of has a row: IP literals in inet_aton forms, full-width and ideographic
dots, IDNA, zone ids, userinfo, encoded dots and slashes, Tomcat-style `..;`. Hypothesis then checks the
two guarantees callers rely on: for any text the only exception is CanonError, and every result is a
fixed point. parse_inet_aton is checked against the C library's own inet_aton (socket.inet_aton).
"""

from __future__ import annotations

import pickle
import random
import socket
import sys
import unicodedata
from ipaddress import IPv4Address, IPv6Address

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from egressgate.policy.canon import (
    CanonError,
    canon_host,
    canon_method,
    canon_path,
    canon_port,
    ip_text,
    join_host_port,
    parse_inet_aton,
    parse_ip_literal,
    split_host_port,
    split_path_query,
)

# ------------------------------------------------------------------------------------------ hosts

HOSTS_OK = [
    # case, trailing dot
    ("example.com", "example.com"),
    ("Example.COM", "example.com"),
    ("EXAMPLE.COM.", "example.com"),
    ("api.openai.com", "api.openai.com"),
    ("localhost", "localhost"),
    ("_dmarc.example.com", "_dmarc.example.com"),
    ("r3---sn-abc.googlevideo.com", "r3---sn-abc.googlevideo.com"),
    ("123.example.com", "123.example.com"),
    ("0x7f.example", "0x7f.example"),
    ("a" * 63 + ".com", "a" * 63 + ".com"),
    (".".join(["a" * 63] * 3) + "." + "b" * 61, ".".join(["a" * 63] * 3) + "." + "b" * 61),
    # full-width / ideographic dots are separators (UTS 46)
    ("example\u3002com", "example.com"),
    ("example\uff0ecom", "example.com"),
    ("example\uff61com", "example.com"),
    ("example\u3002com\u3002", "example.com"),
    ("\uff21\uff30\uff29.example.com", "api.example.com"),  # full-width letters map to ASCII
    ("\uff58\uff4e\uff0d\uff0d\uff5a\uff43\uff41.de", "xn--zca.de"),  # full-width "xn--zca"
    # IDNA / UTS 46 to punycode
    ("b\u00fccher.example", "xn--bcher-kva.example"),
    ("B\u00dcCHER.EXAMPLE.", "xn--bcher-kva.example"),
    ("stra\u00dfe.de", "xn--strae-oqa.de"),  # non-transitional: sharp s kept
    ("\u4f8b\u3048.\u30c6\u30b9\u30c8", "xn--r8jz45g.xn--zckzah"),
    ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ("XN--BCHER-KVA.example", "xn--bcher-kva.example"),
    ("ex\u00adample.com", "example.com"),  # soft hyphen is ignored by UTS 46
    # IPv4 in every inet_aton form
    ("127.0.0.1", "127.0.0.1"),
    ("2130706433", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),
    ("0177.0000.0000.0001", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"),
    ("0x7F.0.0.1", "127.0.0.1"),
    ("0x7f000001", "127.0.0.1"),
    ("0X7F000001", "127.0.0.1"),
    ("127.1", "127.0.0.1"),
    ("127.0.1", "127.0.0.1"),
    ("0", "0.0.0.0"),
    ("00", "0.0.0.0"),
    ("0x0", "0.0.0.0"),
    ("0x7f.0.0x1", "127.0.0.1"),
    ("0251.0376.0251.0376", "169.254.169.254"),
    ("0xa9.0xfe.0xa9.0xfe", "169.254.169.254"),
    ("0xa9fea9fe", "169.254.169.254"),
    ("2852039166", "169.254.169.254"),
    ("169.254.43518", "169.254.169.254"),
    ("169.16689662", "169.254.169.254"),
    ("4294967295", "255.255.255.255"),
    ("127.0.0.1.", "127.0.0.1"),
    ("\uff11\uff12\uff17\uff0e\uff10\uff0e\uff10\uff0e\uff11", "127.0.0.1"),  # full-width digits + dots
    ("127\u30020\u30020\u30021", "127.0.0.1"),
    ("169\uff61254\uff61169\uff61254", "169.254.169.254"),
    (
        "\u2460\u2465\u2468.\u2461\u2464\u2463.\u2460\u2465\u2468.\u2461\u2464\u2463",
        "169.254.169.254",
    ),  # circled digits
    ("0x00000000a9fea9fe", "169.254.169.254"),
    ("0251.0xfe.43518", "169.254.169.254"),
    # IPv6
    ("[::1]", "::1"),
    ("::1", "::1"),
    ("[0:0:0:0:0:0:0:1]", "::1"),
    ("[::]", "::"),
    ("[::ffff:127.0.0.1]", "::ffff:127.0.0.1"),
    ("[::ffff:7f00:1]", "::ffff:127.0.0.1"),
    ("[::FFFF:7F00:0001]", "::ffff:127.0.0.1"),
    ("[::ffff:a9fe:a9fe]", "::ffff:169.254.169.254"),
    ("[64:ff9b::a9fe:a9fe]", "64:ff9b::a9fe:a9fe"),
    ("[2001:DB8::1]", "2001:db8::1"),
    ("[fd00:ec2::254]", "fd00:ec2::254"),
    ("[::127.0.0.1]", "::7f00:1"),
]


@pytest.mark.parametrize(("raw", "expected"), HOSTS_OK, ids=[repr(r)[:40] for r, _ in HOSTS_OK])
def test_canon_host_accepts(raw: str, expected: str) -> None:
    assert canon_host(raw) == expected
    assert canon_host(expected) == expected


HOSTS_BAD = [
    ("", "empty_host"),
    (".", "empty_host"),
    ("a..b", "empty_label"),
    (".example.com", "empty_label"),
    ("example.com..", "empty_label"),
    ("example\u3002\u3002com", "empty_label"),
    ("127.0.0.1..", "empty_label"),
    # userinfo
    ("user@example.com", "userinfo"),
    ("allowed.com@evil.com", "userinfo"),
    ("@example.com", "userinfo"),
    ("a\uff20b.com", "userinfo"),  # full-width @ maps to '@'
    # controls and whitespace
    ("exa\x00mple.com", "control_char"),
    ("example.com\r\nX-Injected: 1", "control_char"),
    ("example.com\n", "control_char"),
    ("\x7fexample.com", "control_char"),
    ("example.com\x85", "control_char"),
    ("example.com ", "whitespace"),
    (" example.com", "whitespace"),
    ("exa mple.com", "whitespace"),
    ("example.com\u00a0", "whitespace"),
    ("example.com\u3000", "whitespace"),
    ("example.com\u2028", "whitespace"),
    # percent-encoding is never decoded in hosts
    ("%65xample.com", "percent_encoded"),
    ("example%2ecom", "percent_encoded"),
    ("127.0.0.1%00", "percent_encoded"),
    ("a\uff05b.com", "percent_encoded"),  # full-width %
    # characters not allowed in names
    ("exa*mple.com", "bad_char"),
    ("*.example.com", "bad_char"),
    ("example.com/", "bad_char"),
    ("a\uff0fb.com", "bad_char"),  # full-width solidus maps to '/'
    ("a\\b.com", "bad_char"),
    ("a!b.com", "bad_char"),
    ("[stripe.com]", "bad_ipv6"),
    ("[[stripe.com]]", "bad_ipv6"),
    ("stripe.com]", "bad_char"),
    ("a\uff1ab.com", "bad_char"),  # full-width colon maps to ':'
    # lengths
    ("a" * 64 + ".com", "label_too_long"),
    (".".join(["a" * 63] * 4), "name_too_long"),
    ("a." * 600, "too_long"),
    # IDNA
    ("\u2603.net", "idna"),  # snowman: disallowed by IDNA2008
    ("\U0001f4a9.la", "idna"),
    ("a\u200db.com", "idna"),  # ZWJ outside its context
    ("xn--abc.com", "bad_punycode"),
    ("xn--.com", "bad_punycode"),
    ("xn--ls8h.la", "bad_punycode"),  # punycode of a disallowed code point
    ("xn--a-.com", "bad_punycode"),
    ("\u0661\u0662\u0663.com", "idna"),  # Arabic-Indic digits: not mapped to ASCII, bidi rule fails
    # ends in a number but is not IPv4
    ("1.2.3.999", "bad_ipv4"),
    ("256.0.0.1", "bad_ipv4"),
    ("999999999999", "bad_ipv4"),
    ("4294967296", "bad_ipv4"),
    ("0x100000000", "bad_ipv4"),
    ("1.2.3.4.5", "bad_ipv4"),
    ("foo.123", "bad_ipv4"),
    ("example.com.42", "bad_ipv4"),
    ("foo.0x10", "bad_ipv4"),
    ("08", "bad_ipv4"),
    ("0378.0.0.1", "bad_ipv4"),
    ("1.16777216", "bad_ipv4"),
    ("1.2.65536", "bad_ipv4"),
    ("0x", "bad_ipv4"),
    ("0x.1", "bad_ipv4"),
    ("\u00fc.1", "bad_ipv4"),
    # IPv6
    ("[fe80::1%25eth0]", "zone_id"),
    ("[fe80::1%eth0]", "zone_id"),
    ("fe80::1%eth0", "zone_id"),
    ("fe80::1%25eth0", "zone_id"),
    ("[::1", "bad_ipv6"),
    ("[]", "bad_ipv6"),
    ("[1.2.3.4]", "bad_ipv6"),
    ("[::1]:443", "bad_ipv6"),
    ("[v1.fe]", "bad_ipv6"),
    ("[12345::1]", "bad_ipv6"),
    ("[::ffff:0127.0.0.1]", "bad_ipv6"),
    ("[::ffff:127.1]", "bad_ipv6"),
    ("1:2:3:4:5:6:7:8:9", "bad_ipv6"),
    ("example.com:443", "port_in_host"),
    ("127.0.0.1:80", "port_in_host"),
    ("example.com:", "port_in_host"),
]


@pytest.mark.parametrize(("raw", "code"), HOSTS_BAD, ids=[repr(r)[:40] for r, _ in HOSTS_BAD])
def test_canon_host_rejects(raw: str, code: str) -> None:
    with pytest.raises(CanonError) as info:
        canon_host(raw)
    assert info.value.code == code, info.value
    assert isinstance(info.value, ValueError)
    assert str(info.value)  # a human message
    with pytest.raises(CanonError):
        parse_ip_literal(raw)


def test_canon_error_shape() -> None:
    with pytest.raises(CanonError) as info:
        canon_host("user@example.com")
    err = info.value
    assert isinstance(err, ValueError) and err.code == "userinfo" and str(err) == err.message
    again = pickle.loads(pickle.dumps(err))  # noqa: S301 -- our own bytes
    assert (again.code, again.message) == (err.code, err.message)


def test_every_control_and_whitespace_code_point_is_rejected() -> None:
    # Exhaustive over Unicode: the fast regex in canon must agree with the Unicode definitions.
    for o in range(sys.maxunicode + 1):
        ch = chr(o)
        control = o < 0x20 or 0x7F <= o < 0xA0
        space = ch.isspace() or unicodedata.category(ch) in ("Zs", "Zl", "Zp")
        if not (control or space):
            continue
        with pytest.raises(CanonError) as info:
            canon_path("/a" + ch)
        assert info.value.code == ("control_char" if control else "whitespace"), hex(o)
        with pytest.raises(CanonError):
            canon_host("a" + ch + ".com")


@pytest.mark.parametrize("raw", [None, 1, b"example.com", ["a"]])
def test_non_text_is_canon_error(raw: object) -> None:
    for fn in (canon_host, canon_path, canon_method, parse_ip_literal, split_path_query):
        with pytest.raises(CanonError) as info:
            fn(raw)  # type: ignore[arg-type]
        assert info.value.code == "not_text"


IP_LITERALS = [
    ("127.0.0.1", IPv4Address("127.0.0.1")),
    ("2130706433", IPv4Address("127.0.0.1")),
    ("0x7f.1", IPv4Address("127.0.0.1")),
    ("0177.0.0.1", IPv4Address("127.0.0.1")),
    ("0", IPv4Address("0.0.0.0")),
    ("[::1]", IPv6Address("::1")),
    ("::ffff:169.254.169.254", IPv6Address("::ffff:a9fe:a9fe")),
    ("\uff11\uff12\uff17\uff0e\uff11", IPv4Address("127.0.0.1")),
    ("example.com", None),
    ("xn--bcher-kva.example", None),
    ("1.example", None),
]


@pytest.mark.parametrize(("raw", "expected"), IP_LITERALS)
def test_parse_ip_literal(raw: str, expected: IPv4Address | IPv6Address | None) -> None:
    assert parse_ip_literal(raw) == expected


def test_ip_text_is_stable_for_mapped_addresses() -> None:
    # Pinned so audit text does not change between Python 3.12 (hex) and 3.13+ (dotted).
    assert ip_text(IPv6Address("::ffff:7f00:1")) == "::ffff:127.0.0.1"
    assert ip_text(IPv6Address("fe80::1%eth0")) == "fe80::1"
    assert ip_text(IPv4Address("10.0.0.1")) == "10.0.0.1"


# ------------------------------------------------------------------------------------------ ports

PORTS_OK = [("443", 443), ("1", 1), ("65535", 65535), ("80", 80), (8080, 8080)]


@pytest.mark.parametrize(("raw", "expected"), PORTS_OK)
def test_canon_port_accepts(raw: str | int, expected: int) -> None:
    assert canon_port(raw) == expected


PORTS_BAD = [
    ("", "empty_port"),
    ("+443", "bad_port"),
    ("-1", "bad_port"),
    (" 443", "bad_port"),
    ("443 ", "bad_port"),
    ("4e2", "bad_port"),
    ("0x1bb", "bad_port"),
    ("\u0664\u0664\u0663", "bad_port"),  # Arabic-Indic digits are digits to str.isdigit
    ("\uff14\uff14\uff13", "bad_port"),  # full-width digits
    ("443\n", "bad_port"),
    ("0443", "port_leading_zero"),
    ("00", "port_leading_zero"),
    ("0", "port_out_of_range"),
    ("65536", "port_out_of_range"),
    ("99999999999999999999", "port_out_of_range"),
    (0, "port_out_of_range"),
    (65536, "port_out_of_range"),
    (True, "bad_port"),
]


@pytest.mark.parametrize(("raw", "code"), PORTS_BAD, ids=[repr(r) for r, _ in PORTS_BAD])
def test_canon_port_rejects(raw: str | int, code: str) -> None:
    with pytest.raises(CanonError) as info:
        canon_port(raw)
    assert info.value.code == code


def test_canon_port_default() -> None:
    assert canon_port(None, 443) == 443
    with pytest.raises(CanonError) as info:
        canon_port(None)
    assert info.value.code == "missing_port"
    with pytest.raises(CanonError):
        canon_port(None, 0)
    with pytest.raises(CanonError) as info:
        canon_port("", 443)  # explicitly empty is not "absent"
    assert info.value.code == "empty_port"


AUTHORITIES_OK = [
    ("example.com", 443, ("example.com", 443)),
    ("Example.COM.:8443", 443, ("example.com", 8443)),
    ("example.com:80", None, ("example.com", 80)),
    ("[::1]:8080", 443, ("::1", 8080)),
    ("[::1]", 443, ("::1", 443)),
    ("[::ffff:7f00:1]:443", None, ("::ffff:127.0.0.1", 443)),
    ("0x7f.1:80", None, ("127.0.0.1", 80)),
    ("b\u00fccher.example:443", None, ("xn--bcher-kva.example", 443)),
]


@pytest.mark.parametrize(("authority", "default", "expected"), AUTHORITIES_OK)
def test_split_host_port(authority: str, default: int | None, expected: tuple[str, int]) -> None:
    assert split_host_port(authority, default) == expected
    host, port = expected
    assert split_host_port(join_host_port(host, port), None) == expected


AUTHORITIES_BAD = [
    ("user:pass@example.com:443", "userinfo"),
    ("example.com@evil.com", "userinfo"),
    ("example.com:+443", "bad_port"),
    ("example.com:0443", "port_leading_zero"),
    ("example.com:65536", "port_out_of_range"),
    ("example.com:0", "port_out_of_range"),
    ("example.com: 443", "whitespace"),
    ("example.com:", "empty_port"),
    ("example.com", "missing_port"),
    (":443", "empty_host"),
    ("::1:443", "unbracketed_ipv6"),
    ("[::1]443", "bad_authority"),
    ("[::1", "bad_ipv6"),
    ("[fe80::1%25eth0]:443", "zone_id"),
    ("example.com:443\r\n", "control_char"),
    ("[[stripe.com]]:80", "bad_authority"),
    ("[2001:Db8::]:443:443", "bad_port"),
    ("1.2.3.999:80", "bad_ipv4"),
]


@pytest.mark.parametrize(("authority", "code"), AUTHORITIES_BAD)
def test_split_host_port_rejects(authority: str, code: str) -> None:
    with pytest.raises(CanonError) as info:
        split_host_port(authority, None)
    assert info.value.code == code


# ------------------------------------------------------------------------------------------ paths

PATHS_OK = [
    ("/", "/"),
    ("", "/"),
    ("/v1/responses", "/v1/responses"),
    ("/v1/responses?stream=true", "/v1/responses"),
    ("?x=1", "/"),
    # unreserved escapes decoded, others upper-cased
    ("/%41%42c", "/ABc"),
    ("/%7e%7Euser", "/~~user"),
    ("/a%2db%5fc", "/a-b_c"),
    ("/%2e", "/"),
    ("/a%2fb", "/a%2Fb"),
    ("/a%2Fb", "/a%2Fb"),
    ("/a%5cb", "/a%5Cb"),
    ("/a%3bb", "/a%3Bb"),
    ("/a%25b", "/a%25b"),
    ("/a%252eb", "/a%252eb"),  # never decoded twice
    ("/caf%c3%a9", "/caf%C3%A9"),
    # dot segments, including encoded ones
    ("/a/b/../c", "/a/c"),
    ("/a/./b", "/a/b"),
    ("/a/b/.", "/a/b/"),
    ("/a/b/..", "/a/"),
    ("/..", "/"),
    ("/../../etc/passwd", "/etc/passwd"),
    ("/v1/../admin", "/admin"),
    ("/%2e%2e/admin", "/admin"),
    ("/%2E%2E/admin", "/admin"),
    ("/.%2e/admin", "/admin"),
    ("/v1/%2e%2e/%2e%2e/%2e%2e/admin", "/admin"),
    ("/v1/%2e/x", "/v1/x"),
    ("/a/...b/c", "/a/...b/c"),  # dots then a letter: no server reads it as '..'
    ("/compare/main...dev", "/compare/main...dev"),
    ("/a/b./c", "/a/b./c"),  # kept; deny rules also match the Windows reading '/a/b/c'
    ("/a/..b/c", "/a/..b/c"),
    # consecutive slashes are kept
    ("//a//b", "//a//b"),
    ("/a//b/../c", "/a//c"),
    ("/a//b/c/../d", "/a//b/d"),
    # raw characters outside RFC 3986 are encoded; non-ASCII as UTF-8
    ("/a|b", "/a%7Cb"),
    ("/a%7cb", "/a%7Cb"),
    ('/"<>^`{}[]', "/%22%3C%3E%5E%60%7B%7D%5B%5D"),
    ("/caf\u00e9", "/caf%C3%A9"),
    ("/\udcff", "/%FF"),  # surrogateescape'd raw byte (how mitmproxy decodes a non-UTF-8 path)
    # sub-delims, ':' and '@' stay raw
    ("/a:b@c!$&'()*+,;=", "/a:b@c!$&'()*+,;="),
    ("/a;b/c", "/a;b/c"),
    # look-alikes of the traversal spellings that are not traversal stay accepted
    ("/a/b%3Bc", "/a/b%3Bc"),
    ("/x/%252fetc", "/x/%252fetc"),
    ("/a%2F%2Fb", "/a%2F%2Fb"),
    ("/a/..x%2Fb", "/a/..x%2Fb"),
    ("/files/%252e%252ex", "/files/%252e%252ex"),
    ("/caf%C3%A0", "/caf%C3%A0"),
    ("/%C0x", "/%C0x"),  # Latin-1 capital A grave: not an overlong sequence
]


@pytest.mark.parametrize(("raw", "expected"), PATHS_OK, ids=[repr(r)[:40] for r, _ in PATHS_OK])
def test_canon_path_accepts(raw: str, expected: str) -> None:
    assert canon_path(raw) == expected
    assert canon_path(expected) == expected


PATHS_BAD = [
    ("*", "not_origin_form"),
    ("v1/responses", "not_origin_form"),
    ("http://example.com/", "not_origin_form"),
    ("%2Fetc", "not_origin_form"),
    ("/a#frag", "fragment"),
    ("/a?b#frag", "fragment"),
    ("/a\\b", "backslash"),
    ("/..\\..\\etc", "backslash"),
    ("/a\x00b", "control_char"),
    ("/a\rb", "control_char"),
    ("/a\nb", "control_char"),
    ("/a?x=\r\nInjected: 1", "control_char"),
    ("/a\tb", "control_char"),
    ("/a\x7f", "control_char"),
    ("/a b", "whitespace"),
    ("/a\u00a0b", "whitespace"),
    ("/a%", "bad_percent"),
    ("/a%4", "bad_percent"),
    ("/a%zz", "bad_percent"),
    ("/a%%41", "bad_percent"),
    ("/a%\u00e9\u00e9", "bad_percent"),
    ("/a%00b", "nul"),
    ("/..;/admin", "dot_segment_param"),
    ("/public/..;jsessionid=1/admin", "dot_segment_param"),
    ("/public/.;/admin", "dot_segment_param"),
    ("/public/%2e%2e;/admin", "dot_segment_param"),
    ("/files/..%2Fadmin", "encoded_traversal"),
    ("/files/..%2fadmin", "encoded_traversal"),
    ("/files/%2e%2e%2fadmin", "encoded_traversal"),
    ("/files/a%2F..%2Fb", "encoded_traversal"),
    ("/files/..%5Cadmin", "encoded_traversal"),
    ("/files/.%5C", "encoded_traversal"),
    ("/%2e%2e%3B/admin", "encoded_traversal"),
    ("/%2e%2e%3bjsessionid=x/admin", "encoded_traversal"),
    ("/public/%252e%252e/admin", "encoded_traversal"),
    ("/public/%25%32%65%25%32%65/admin", "encoded_traversal"),
    ("/public/..%252Fadmin", "encoded_traversal"),
    ("/public/..%255cadmin", "encoded_traversal"),
    ("/public/%252e", "encoded_traversal"),
    ("/public/%C0%AE%C0%AE/admin", "overlong_utf8"),
    ("/public/%c0%ae%c0%ae/admin", "overlong_utf8"),
    ("/public/%C1%9C", "overlong_utf8"),
    ("/public/%E0%80%AE", "overlong_utf8"),
    ("/public/%F0%80%80%AE", "overlong_utf8"),
    ("/public/\udcc0\udcae", "overlong_utf8"),  # the same bytes sent raw
    # segments Windows (trailing dots and spaces dropped) or NFKC folding reads as a dot segment
    ("/a/.../b", "dot_segment_trailing"),  # RFC 3986: not a dot segment; Windows: no agreed reading
    ("/a/..../b", "dot_segment_trailing"),
    ("/a/...%2Fb", "encoded_traversal"),  # '...' once '%2F' is a separator
    ("/files/%252e%252e%252e", "encoded_traversal"),
    ("/public/..%20/admin", "encoded_traversal"),
    ("/public/.%20./admin", "encoded_traversal"),
    ("/public/..%2520/admin", "encoded_traversal"),
    ("/public/%EF%BC%8E%EF%BC%8E/admin", "encoded_traversal"),  # fullwidth full stops
    ("/public/%E2%80%A5/admin", "encoded_traversal"),  # TWO DOT LEADER, NFKC '..'
    ("/public/..%EF%BC%8Fadmin", "encoded_traversal"),  # fullwidth solidus as the separator
    ("/public/..%E2%88%95admin", "encoded_traversal"),  # DIVISION SLASH (best-fit '/')
    ("/a//../b", "ambiguous_traversal"),
    # '..' removing a segment that some server splits first (decoded separator, ';', '?')
    ("/admin%2Fx/..", "ambiguous_traversal"),
    ("/admin%5cx/../y", "ambiguous_traversal"),
    ("/admin%252Fx/..", "ambiguous_traversal"),
    ("/admin%EF%BC%8Fx/..", "ambiguous_traversal"),
    ("/admin;x/../y", "ambiguous_traversal"),
    ("/admin%3Bx/../y", "ambiguous_traversal"),
    ("/admin%3Fx/../y", "ambiguous_traversal"),
    ("/public/x//../../admin", "ambiguous_traversal"),
    ("/public//%2e%2e/admin", "ambiguous_traversal"),
    ("/a//..", "ambiguous_traversal"),
    ("/a/b//c/../../d", "ambiguous_traversal"),
    ("/\ud800", "bad_char"),  # lone surrogate that is not a surrogateescape'd byte
    ("/" + "a" * 70000, "too_long"),
]


@pytest.mark.parametrize(("raw", "code"), PATHS_BAD, ids=[repr(r)[:40] for r, _ in PATHS_BAD])
def test_canon_path_rejects(raw: str, code: str) -> None:
    with pytest.raises(CanonError) as info:
        canon_path(raw)
    assert info.value.code == code


def test_encoded_slash_and_backslash_are_distinct() -> None:
    assert canon_path("/a%2Fb") != canon_path("/a/b")
    assert canon_path("/a%2Fb").count("/") == 1
    assert canon_path("/a%5Cb") == "/a%5Cb"


def test_split_path_query() -> None:
    assert split_path_query("/a/../b?x=1&y=%2e") == ("/b", "x=1&y=%2e")
    assert split_path_query("/a") == ("/a", "")
    assert split_path_query("/a?") == ("/a", "")
    assert split_path_query("/a?b?c") == ("/a", "b?c")


# ------------------------------------------------------------------------------------------ methods

METHODS_OK = [("GET", "GET"), ("get", "GET"), ("Post", "POST"), ("PROPFIND", "PROPFIND"), ("M-SEARCH", "M-SEARCH")]


@pytest.mark.parametrize(("raw", "expected"), METHODS_OK)
def test_canon_method_accepts(raw: str, expected: str) -> None:
    assert canon_method(raw) == expected


METHODS_BAD = [
    ("", "empty_method"),
    ("GET ", "bad_method"),
    (" GET", "bad_method"),
    ("GE T", "bad_method"),
    ("GET\r\n", "bad_method"),
    ("G(ET", "bad_method"),
    ("G\u00c9T", "bad_method"),
    ("\u0131nsert", "bad_method"),  # dotless i: upper() would give "INSERT"
    ("\ufb00", "bad_method"),  # "ff" ligature: upper() would give "FF"
    ("A" * 33, "too_long"),
]


@pytest.mark.parametrize(("raw", "code"), METHODS_BAD)
def test_canon_method_rejects(raw: str, code: str) -> None:
    with pytest.raises(CanonError) as info:
        canon_method(raw)
    assert info.value.code == code


# ------------------------------------------------------------------------------------------ properties

CANON_FUNCTIONS = {"host": canon_host, "path": canon_path, "method": canon_method}


def _fixed_point(fn, raw: str) -> None:  # type: ignore[no-untyped-def]
    try:
        once = fn(raw)
    except CanonError as exc:
        assert exc.code and isinstance(exc.code, str)
        return
    assert fn(once) == once, (raw, once)


_ANY_TEXT = st.text(alphabet=st.characters(codec=None), max_size=80)

_HOST_ATOMS = st.sampled_from(
    [
        "a",
        "Z",
        "0",
        "9",
        "-",
        "_",
        ".",
        "..",
        "0x",
        "0X",
        "7f",
        "ff",
        "08",
        "0177",
        "255",
        "256",
        "4294967295",
        "xn--",
        "xn--zca",
        "xn--bcher-kva",
        "bücher",
        "ß",
        "ü",
        "İ",
        "ǅ",
        "例え",
        "\u3002",
        "\uff0e",
        "\uff61",
        "\uff11",
        "\uff41",
        "\uff05",
        "\uff20",
        "\uff1a",
        "\u00ad",
        "\u200d",
        "\u200c",
        "%",
        "%2e",
        "@",
        ":",
        "[",
        "]",
        "::",
        "::1",
        "::ffff:",
        "%25",
        "%eth0",
        " ",
        "\t",
        "\x00",
        "\r\n",
        "*",
        "/",
        "\\",
        "\u0661",
        "\u05d0",
        "a" * 63,
        "é",
        "ﬀ",
    ]
)
_NEAR_HOSTS = st.lists(_HOST_ATOMS, max_size=12).map("".join)
# Mostly-valid names: LDH/Unicode labels, any of the four dots as separators, random case, trailing dot.
_LABEL = st.text(alphabet="abcXYZ019-_\u00fc\u00df\u00c9\u4f8b\u0430\uff41\uff11", min_size=1, max_size=12)
_SEPARATOR = st.sampled_from([".", ".", "\u3002", "\uff0e", "\uff61"])
_NAMES = st.tuples(st.lists(st.tuples(_LABEL, _SEPARATOR), min_size=1, max_size=5), st.booleans()).map(
    lambda t: "".join(label + sep for label, sep in t[0])[: None if t[1] else -1]
)

_NUMBER_PART = st.one_of(
    st.integers(0, 2**33).map(str),
    st.integers(0, 2**33).map(lambda n: "0" + format(n, "o")),
    st.integers(0, 2**33).map(lambda n: "0x" + format(n, "x")),
    st.integers(0, 2**33).map(lambda n: "0X" + format(n, "X")),
    st.sampled_from(["0x", "08", "09", "00", "0", "", "0xg", "1e2"]),
)
_NUMERIC_HOSTS = st.lists(_NUMBER_PART, min_size=1, max_size=5).map(".".join)

_PATH_ATOMS = st.sampled_from(
    [
        "/",
        "//",
        ".",
        "..",
        "...",
        "a",
        "B",
        "~",
        "-",
        "_",
        ";",
        ";x",
        "%",
        "%2e",
        "%2E",
        "%2f",
        "%2F",
        "%5c",
        "%5C",
        "%41",
        "%7e",
        "%25",
        "%00",
        "%0",
        "%zz",
        "%c3%a9",
        "é",
        "\udcff",
        "\ud800",
        "|",
        "?",
        "#",
        "\\",
        " ",
        "\t",
        "\r",
        "\n",
        "\x00",
        ":",
        "@",
        "!",
        "'",
        "[",
        "]",
        "{",
        "\u3002",
    ]
)
_NEAR_PATHS = st.lists(_PATH_ATOMS, max_size=16).map("".join)
_ROOTED_PATHS = _NEAR_PATHS.map(lambda p: "/" + p)

_METHOD_TEXT = st.text(
    alphabet=st.sampled_from("GETPOSTgetpost-_!#$%&'*+.^`|~ \t\r\n\u0131\u017f\ufb00\u00c9(),/"), max_size=40
)

_SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(_ANY_TEXT)
@example("0x7f.1")
@example("[::ffff:7f00:1]")
@example("example\u3002com\u3002")
def test_any_text_host(raw: str) -> None:
    _fixed_point(canon_host, raw)
    try:
        ip = parse_ip_literal(raw)
    except CanonError:
        return
    assert ip is None or canon_host(raw) == ip_text(ip)


@_SETTINGS
@given(st.one_of(_NEAR_HOSTS, _NAMES))
@example("B\u00fccher\u3002Example\uff0eCOM\uff61")
def test_near_valid_host(raw: str) -> None:
    _fixed_point(canon_host, raw)


@_SETTINGS
@given(_NUMERIC_HOSTS)
def test_numeric_host(raw: str) -> None:
    _fixed_point(canon_host, raw)


@_SETTINGS
@given(_ANY_TEXT)
def test_any_text_path(raw: str) -> None:
    _fixed_point(canon_path, raw)


@_SETTINGS
@given(st.one_of(_NEAR_PATHS, _ROOTED_PATHS))
@example("/%2e%2e/%2e%2e/x")
@example("/.//x")
def test_near_valid_path(raw: str) -> None:
    _fixed_point(canon_path, raw)
    try:
        path = canon_path(raw)
    except CanonError:
        return
    segments = path.split("/")
    assert path.startswith("/")
    assert "." not in segments and ".." not in segments
    assert all(c.isascii() and c not in " \\#?" and c.isprintable() for c in path)


@_SETTINGS
@given(st.one_of(_ANY_TEXT, _METHOD_TEXT))
def test_any_text_method(raw: str) -> None:
    _fixed_point(canon_method, raw)


@_SETTINGS
@given(st.one_of(_ANY_TEXT, st.tuples(_NEAR_HOSTS, st.sampled_from(["", ":", ":443", ":0443", ":+1"])).map("".join)))
def test_any_text_authority(raw: str) -> None:
    try:
        host, port = split_host_port(raw, 443)
    except CanonError:
        return
    assert split_host_port(join_host_port(host, port), None) == (host, port)


@_SETTINGS
@given(_ANY_TEXT)
def test_any_text_port(raw: str) -> None:
    try:
        port = canon_port(raw)
    except CanonError:
        return
    assert 1 <= port <= 65535
    assert canon_port(str(port)) == port


# The two differential tests below also check a BATCH of subjects per example, built by random.Random from a
# seed Hypothesis draws, in the shapes of their strategies: Hypothesis's own work per example (drawing,
# mutating, replaying) was most of their CPU, the comparison itself cheap. Hypothesis still draws a subject
# of its own in every example (its edge cases), the @example cases run as before (with an empty batch).
BATCH = 5


def _seeded(build) -> st.SearchStrategy[list]:
    return st.integers(min_value=0, max_value=2**64 - 1).map(lambda seed: build(random.Random(seed)))


def _random_number(rnd: random.Random) -> int:
    """0..2**33, boundary-focused as Hypothesis's integers are: near a power of two (a part's limit, an
    octet, the 32-bit wrap), small, or anywhere."""
    kind = rnd.randrange(3)
    if kind == 0:
        return max(0, 2 ** rnd.choice((7, 8, 15, 16, 23, 24, 31, 32, 33)) + rnd.randint(-2, 2))
    return rnd.randint(0, 300) if kind == 1 else rnd.randint(0, 2**33)


def _random_number_part(rnd: random.Random) -> str:
    """A part as _NUMBER_PART draws it: decimal, octal, 0x, 0X, or one of its odd spellings."""
    n, kind = _random_number(rnd), rnd.randrange(5)
    if kind == 4:
        return rnd.choice(["0x", "08", "09", "00", "0", "", "0xg", "1e2"])
    return (str(n), "0" + format(n, "o"), "0x" + format(n, "x"), "0X" + format(n, "X"))[kind]


def _random_inet_texts(rnd: random.Random) -> list[str]:
    """BATCH texts, each a _NUMERIC_HOSTS or a short text of the same alphabet, as the test's strategy."""
    return [
        ".".join(_random_number_part(rnd) for _ in range(rnd.randint(1, 5)))
        if rnd.random() < 0.5
        else "".join(rnd.choice("0123456789abcdefxX.") for _ in range(rnd.randint(0, 24)))
        for _ in range(BATCH)
    ]


@settings(max_examples=300, deadline=None)
@given(st.one_of(_NUMERIC_HOSTS, st.text(alphabet="0123456789abcdefxX.", max_size=24)), _seeded(_random_inet_texts))
@example("0x", [])
@example("1.", [])
@example("0x7f.1", [])
def test_parse_inet_aton_matches_the_c_library(raw: str, batch: list[str]) -> None:
    texts = [raw, *batch]  # the drawn text first
    for raw in texts:
        try:
            expected: bytes | None = socket.inet_aton(raw)
        except OSError:
            expected = None
        got = parse_inet_aton(raw)
        assert (got.packed if got else None) == expected, raw
        if expected is not None and not raw.endswith("."):
            # Whatever the C library reads as an address, canon_host reads as the same address.
            assert canon_host(raw) == str(IPv4Address(expected))


def _rfc3986_remove_dot_segments(inp: str) -> str:
    """RFC 3986 5.2.4, transcribed literally (string buffers), as an independent reference."""
    out = ""
    while inp:
        if inp.startswith("../"):
            inp = inp[3:]
        elif inp.startswith("./"):
            inp = inp[2:]
        elif inp.startswith("/./"):
            inp = "/" + inp[3:]
        elif inp == "/.":
            inp = "/"
        elif inp.startswith("/../") or inp == "/..":
            inp = "/" + inp[4:]
            out = out[: out.rfind("/")] if "/" in out else ""
        elif inp in (".", ".."):
            inp = ""
        else:
            end = inp.find("/", 1 if inp.startswith("/") else 0)
            end = len(inp) if end < 0 else end
            out, inp = out + inp[:end], inp[end:]
    return out


def _merge_slashes(path: str) -> str:
    while "//" in path:
        path = path.replace("//", "/")
    return path


_DOT_ATOMS = ["/", "//", ".", "..", "a", "b", "%2e", "%2E%2e"]
_DOT_PATHS = st.lists(st.sampled_from(_DOT_ATOMS), max_size=14).map(lambda atoms: "/" + "".join(atoms))


def _random_dot_paths(rnd: random.Random) -> list[str]:
    """BATCH paths as _DOT_PATHS draws them: "/" and 0-14 _DOT_ATOMS."""
    return ["/" + "".join(rnd.choice(_DOT_ATOMS) for _ in range(rnd.randint(0, 14))) for _ in range(BATCH)]


@settings(max_examples=300, deadline=None)
@given(_DOT_PATHS, _seeded(_random_dot_paths))
@example("/a//../b", [])
@example("/a/b//c/../../d", [])
def test_dot_segments_match_rfc3986_and_slash_merging_servers(raw: str, batch: list[str]) -> None:
    paths = [raw, *batch]  # the drawn path first
    for raw in paths:
        decoded = raw.replace("%2e", ".").replace("%2E", ".")
        try:
            got = canon_path(raw)
        except CanonError as exc:
            if exc.code == "dot_segment_trailing":  # '...': Windows drops trailing dots, no agreed reading
                assert any(len(seg) > 2 and set(seg) == {"."} for seg in decoded.split("/")), raw
            else:
                assert exc.code == "ambiguous_traversal"
            continue
        assert got == (_rfc3986_remove_dot_segments(decoded) or "/")
        # A server that merges slashes before resolving dot segments reaches the same resource.
        assert _merge_slashes(got) == (_rfc3986_remove_dot_segments(_merge_slashes(decoded)) or "/")
