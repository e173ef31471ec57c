"""The pure TLS parsing behind passthrough routes (egressgate/gateway/layers/client_hello.py), table-driven.

Real ClientHellos come from Python's TLS client (captured from a MemoryBIO); hostile ones are that hello
with one thing changed. Each refusal row has its accepting twin (the same hello, honest), so a check
that refused everything would fail too.
"""

from __future__ import annotations

import contextlib
import ssl
import struct

import pytest

from egressgate.gateway.layers.client_hello import HRR_RANDOM, check_hello, read_sni, server_hello_kind
from egressgate.gateway.layers.tls_limits import HelloScan


def hello_record(sni: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def handshake(record: bytes) -> bytes:
    """The handshake message of a one-record ClientHello."""
    return record[5:]


def with_extension(msg: bytes, ext_type: int, body: bytes) -> bytes:
    at = 4 + 2 + 32
    at += 1 + msg[at]
    at += 2 + struct.unpack("!H", msg[at:at + 2])[0]
    at += 1 + msg[at]
    ext_len = struct.unpack("!H", msg[at:at + 2])[0]
    exts = msg[at + 2:at + 2 + ext_len] + struct.pack("!HH", ext_type, len(body)) + body
    body_out = msg[4:at] + struct.pack("!H", len(exts)) + exts
    return b"\x01" + len(body_out).to_bytes(3, "big") + body_out


def sni_body(*names: bytes, kind: int = 0) -> bytes:
    entries = b"".join(bytes([kind]) + struct.pack("!H", len(n)) + n for n in names)
    return struct.pack("!H", len(entries)) + entries


GOOD = handshake(hello_record("api.example.com"))


@pytest.mark.parametrize(("msg", "host", "sni", "reason", "detail"), [
    (GOOD, "api.example.com", "api.example.com", None, None),
    (handshake(hello_record("API.Example.COM.")), "api.example.com", "API.Example.COM.", None, None),
    (handshake(hello_record("xn--bcher-kva.example")), "xn--bcher-kva.example", "xn--bcher-kva.example", None, None),
    (GOOD, "other.example.com", "api.example.com", "host_mismatch", "sni_mismatch"),
    (GOOD, "api.example.com.evil.test", "api.example.com", "host_mismatch", "sni_mismatch"),
    (handshake(hello_record(None)), "api.example.com", None, "host_mismatch", "sni_missing"),
    (handshake(hello_record(None)), "192.0.2.7", None, None, None),  # IP literal: no SNI is the norm
    (GOOD, "192.0.2.7", "api.example.com", "host_mismatch", "sni_mismatch"),
    (with_extension(GOOD, 0x0000, sni_body(b"other.example.com")), "api.example.com", None,
     "host_mismatch", "sni_ambiguous"),
    (with_extension(handshake(hello_record(None)), 0x0000, sni_body(b"api.example.com", b"other.example.com")),
     "api.example.com", None, "host_mismatch", "sni_ambiguous"),
    (with_extension(handshake(hello_record(None)), 0x0000, sni_body(b"api.example.com", kind=1)),
     "api.example.com", None, "host_mismatch", "sni_ambiguous"),
    (with_extension(handshake(hello_record(None)), 0x0000, b"\x00\x05\x00\x00"), "api.example.com", None,
     "invalid_request", "client_hello_unparseable"),  # malformed list length: mitmproxy's parser fails first
    (with_extension(handshake(hello_record(None)), 0x0000, sni_body(b"api\xffexample.com")), "api.example.com",
     "api\xffexample.com", "host_mismatch", "sni_invalid"),
    (with_extension(handshake(hello_record(None)), 0x0000, sni_body(b"api.example.com/x")), "api.example.com",
     "api.example.com/x", "host_mismatch", "sni_invalid"),
    (with_extension(GOOD, 0xFE0D, b"\x00" * 40), "api.example.com", None, "protocol_not_allowed",
     "encrypted_client_hello"),
    (with_extension(GOOD, 0xFFCE, b"\x00" * 40), "api.example.com", None, "protocol_not_allowed",
     "encrypted_server_name"),
    (b"\x02" + GOOD[1:], "api.example.com", None, "protocol_not_allowed", "not_client_hello"),
    (GOOD[:60], "api.example.com", None, "invalid_request", "client_hello_unparseable"),
], ids=lambda v: "hello" if isinstance(v, bytes) else None)  # hellos hold a fresh random: ids must not (xdist)
def test_check_hello(msg, host, sni, reason, detail):
    got_sni, refusal = check_hello(msg, host)
    assert got_sni == sni
    if reason is None:
        assert refusal is None
    else:
        assert refusal is not None and (str(refusal.reason), refusal.detail) == (reason, detail)
        assert host.split(".")[0] in refusal.message or reason != "host_mismatch"


def test_read_sni_is_what_a_strict_server_would_read():
    assert read_sni(GOOD) == ("api.example.com", None)
    assert read_sni(b"") == (None, "not_client_hello")


def server_hello(random: bytes) -> bytes:
    body = b"\x03\x03" + random + b"\x00" + b"\x13\x01" + b"\x00" + b"\x00\x00"
    return b"\x02" + len(body).to_bytes(3, "big") + body


def records(msg: bytes, size: int) -> bytes:
    return b"".join(b"\x16\x03\x03" + struct.pack("!H", len(msg[i:i + size])) + msg[i:i + size]
                    for i in range(0, len(msg), size))


@pytest.mark.parametrize(("stream", "kind"), [
    (records(server_hello(HRR_RANDOM), 16384), "hrr"),
    (records(server_hello(b"\x11" * 32), 16384), "other"),
    (records(server_hello(HRR_RANDOM), 7), "hrr"),  # fragmented over records: still recognized
    (b"\x15\x03\x03\x00\x02\x02\x28", "other"),  # an alert
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", "other"),  # not TLS
])
def test_server_hello_kind(stream, kind):
    scan, buf = HelloScan(), bytearray()
    found = None
    for i in range(len(stream)):  # one byte per read: decided exactly when enough has arrived
        buf.append(stream[i])
        found = server_hello_kind(scan, buf)
        if found is not None:
            break
    assert found == kind
