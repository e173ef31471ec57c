"""Parsers and the answer filter as pure functions: shapes the end-to-end tests cannot easily produce."""

from __future__ import annotations

import contextlib
import ipaddress
import struct

import pytest
from dnslib import AAAA, HTTPS, RD, RR, Buffer, DNSLabel
from hypothesis import given, settings
from hypothesis import strategies as st

from egressgate.dns.filter import filter_answer, sanitize_svcb
from egressgate.dns.upstream import BadReply, build_query, parse_reply, reply_matches
from egressgate.dns.wire import Drop, Malformed, parse_query


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=700))
def test_parse_query_only_raises_its_own_errors(data):
    with contextlib.suppress(Drop, Malformed):
        parse_query(data, 1024)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=12, max_size=700))
def test_parse_reply_only_raises_badreply(data):
    with contextlib.suppress(BadReply):
        parse_reply(data, 0)


def test_parse_reply_survives_deep_pointer_chain():
    # dnslib decodes compression pointers recursively: a long backward chain raises RecursionError there.
    # The chain lives in the rdata of a first (NULL) record; the second record's owner points at its end.
    _, question = build_query(7, (b"a", b"example"), 1, 1232)
    body = bytearray(struct.pack("!HHHHHH", 7, 0x8180, 1, 2, 0, 0) + question)
    chain = bytearray()
    start = len(body) + 11  # after root owner (1) + type/class/ttl/rdlength (10)
    chain += b"\x01x\x00"
    for i in range(3000):
        chain += struct.pack("!H", 0xC000 | (start if i == 0 else start + len(chain) - 2))
    body += b"\x00" + struct.pack("!HHIH", 10, 1, 60, len(chain)) + chain
    owner = start + len(chain) - 2
    body += struct.pack("!HHHIH", 0xC000 | owner, 1, 1, 60, 4) + b"\x5d\xb8\xd8\x22"
    assert reply_matches(bytes(body), 7, question)
    with pytest.raises(BadReply):
        parse_reply(bytes(body), len(question))


def test_reply_must_echo_question_and_id():
    packet, question = build_query(99, (b"allowed", b"example", b"com"), 1, 1232)
    reply = bytearray(packet)
    reply[2] |= 0x80
    assert reply_matches(bytes(reply), 99, question)
    assert not reply_matches(bytes(reply), 98, question)
    other = bytearray(reply)
    other[13] = ord("b")  # a different name
    assert not reply_matches(bytes(other), 99, question)
    upper = bytearray(reply)
    upper[13] = ord("A")  # case differs only: still our question
    assert reply_matches(bytes(upper), 99, question)
    wrong_type = bytes(reply[: len(question) + 12 - 4]) + b"\x00\x1c\x00\x01"
    assert not reply_matches(wrong_type, 99, question)


def rr(owner: str, rtype: int, rdata) -> RR:
    return RR(DNSLabel(owner), rtype, 1, 60, rdata)


def a6(text: str) -> AAAA:
    return AAAA(tuple(ipaddress.IPv6Address(text).packed))


@pytest.mark.parametrize(
    "address",
    [
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "64:ff9b::a9fe:a9fe",
        "::1",
        "fe80::1",
        "fd00::1",
        "2002:7f00:1::",
        "::",
        "::127.0.0.1",
        "ff02::1",
    ],
)
def test_embedded_and_non_global_ipv6_removed(address):
    result = filter_answer(DNSLabel("h.example.com"), 28, [rr("h.example.com", 28, a6(address))], [], ())
    assert result.answers == () and result.emptied


def test_svcb_type64_hints_stripped():
    https = HTTPS.fromZone(["1", "svc.example.net.", "alpn=h2", "ipv4hint=10.0.0.1", "ipv6hint=::1", "port=8443"])
    buffer = Buffer()
    https.pack(buffer)
    record = rr("_8443._foo.svc.example.com", 64, RD(bytes(buffer.data)))
    clean = sanitize_svcb(record)
    assert clean is not None
    raw = bytes(clean.rdata.data)
    parsed = HTTPS.parse(Buffer(raw), len(raw))
    assert [k for k, _ in parsed.params] == [1, 3]
    assert parsed.target == [b"svc", b"example", b"net"]


def test_svcb_garbage_is_removed():
    assert sanitize_svcb(rr("x.example.com", 64, RD(b"\x00\x01\x40" + b"a" * 70))) is None
    assert sanitize_svcb(rr("x.example.com", 64, RD(b"\x00"))) is None


def test_cname_loop_and_long_chain():
    loop = [rr("a.example.com", 5, _cname("b.example.com")), rr("b.example.com", 5, _cname("a.example.com"))]
    result = filter_answer(DNSLabel("a.example.com"), 1, loop, [], ())
    assert not result.emptied and len(result.answers) == 2  # nothing removed, no address: NOERROR/no data
    chain = [rr(f"c{i}.example.com", 5, _cname(f"c{i + 1}.example.com")) for i in range(30)]
    chain.append(rr("c30.example.com", 1, _a("93.184.216.1")))
    result = filter_answer(DNSLabel("c0.example.com"), 1, chain, [], ())
    assert result.emptied and all(r.rtype == 5 for r in result.answers)


def _cname(target: str):
    from dnslib import CNAME

    return CNAME(target)


def _a(text: str):
    from dnslib import A

    return A(text)
