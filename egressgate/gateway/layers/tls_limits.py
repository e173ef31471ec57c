"""The client's TLS ClientHello with a size bound (`limits.max_client_hello_bytes`).

mitmproxy's ClientTLSLayer buffers the client's first TLS records until they hold the whole ClientHello,
whose 24-bit length may announce up to 16 MiB spread over any number of records, and on *every* read
re-joins and re-parses the whole buffer (`tls.parse_client_hello`): memory grows linearly and CPU
quadratically with what a client streams, bounded only by `limits.tls_handshake_timeout`. On the single
event loop that serves every sandbox, one such connection (or a few) starved all the others.

`BoundedClientTLSLayer` is the gateway's ClientTLSLayer: it walks the incoming records *incrementally*
(each byte is looked at once) and hands the buffer to mitmproxy's parser only once the announced
ClientHello has fully arrived, re-framed into full-size records (mitmproxy joins record bodies one `+=`
at a time: thousands of tiny records would make even that one parse quadratic), so parsing is linear.
It refuses, with a fatal TLS alert and a close, as soon as either the announced ClientHello cannot fit
in the bound or the buffered record bytes exceed it (so at most the bound plus one read is buffered);
the event is audited like the other limit events (limit_audit.py, reason `client_hello_too_large`).
Real ClientHellos, even with post-quantum key shares, are under 8 KiB; the default bound is 64 KiB.
OpenSSL, which handles the rest of the handshake (and the upstream's side of it), bounds every later
handshake message itself, so this is the only handshake buffer left to mitmproxy's Python code. DTLS is
never reached: layers/next_layer.py refuses UDP.

layers/next_layer.py and http_limits.py build every ClientTLSLayer through `client_tls_layer()`.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import commands, layer
from mitmproxy.proxy.layers import tls

from egressgate.policy.reasons import Reason

if TYPE_CHECKING:
    from egressgate.gateway.shared.context import Runtime

logger = logging.getLogger(__name__)

RECORD_HEADER = 5  # content type, version (2), length (2)
HANDSHAKE_HEADER = 4  # msg type, length (3)
MAX_RECORD = 16384  # largest plaintext record body (RFC 8446 5.1)
# A fatal `illegal_parameter` alert (RFC 8446 6.2; what OpenSSL sends for an excessive message size),
# sent in clear: no TLS state exists yet.
ALERT_ILLEGAL_PARAMETER = b"\x15\x03\x03\x00\x02\x02\x2f"
# The alert is written before the abort is scheduled; this only lets it leave. mitmproxy does not always
# close a client connection inside a CONNECT tunnel on a layer's CloseConnection (it reads on, and we
# discard, until the abort), so the abort comes soon, not after http1_framing.ABORT_GRACE.
ALERT_GRACE = 0.1  # seconds


class HelloScan:
    """Incremental walk over the records of a ClientHello. `feed(buffer)` resumes where it stopped, so
    every byte is looked at once however the client splits its records across reads; the record bodies
    are collected as they pass (`hello`), so the complete ClientHello can be handed on re-framed."""

    __slots__ = ("announced", "body", "hello", "invalid", "offset", "version")

    def __init__(self) -> None:
        self.offset = 0  # index in the buffer of the next unread byte (record header or body)
        self.body = 0  # bytes of the current record's body not yet in the buffer
        self.hello = bytearray()  # handshake bytes (record bodies) received
        self.announced: int | None = None  # ClientHello size incl. its 4-byte header, once known
        self.version = b"\x03\x01"  # record-layer version of the first record
        self.invalid = False  # not a TLS handshake record (or an empty one)

    @property
    def complete(self) -> bool:
        """The announced ClientHello and the whole record that ends it have arrived."""
        return self.announced is not None and len(self.hello) >= self.announced and self.body == 0

    def feed(self, buf: bytearray) -> None:
        n = len(buf)
        while not self.invalid and not self.complete:
            if self.body:
                take = min(self.body, n - self.offset)
                if take == 0:
                    return
                self.hello += buf[self.offset:self.offset + take]
                self.offset += take
                self.body -= take
                if self.announced is None and len(self.hello) >= HANDSHAKE_HEADER:
                    self.announced = struct.unpack("!I", b"\x00" + self.hello[1:4])[0] + HANDSHAKE_HEADER
                continue
            if n - self.offset < RECORD_HEADER:
                return
            header = bytes(buf[self.offset:self.offset + RECORD_HEADER])
            self.body = struct.unpack("!H", header[3:])[0]
            if not starts_like_tls_record(header) or self.body == 0:
                self.invalid = True
                return
            if self.offset == 0:
                self.version = header[1:3]
            self.offset += RECORD_HEADER

    def reframed(self, buf: bytearray) -> bytearray:
        """The complete ClientHello's records rebuilt as full-size records, then the bytes after them.
        Handshake messages may be fragmented over records at will (RFC 8446 5.1) and the transcript
        covers messages, not records, so this is the same handshake; but mitmproxy's parser, which joins
        record bodies one `+=` at a time, now sees a handful of records instead of thousands."""
        out = bytearray()
        for i in range(0, len(self.hello), MAX_RECORD):
            body = self.hello[i:i + MAX_RECORD]
            out += b"\x16" + self.version + struct.pack("!H", len(body)) + body
        out += buf[self.offset:]
        return out


# (client id, source address, bytes buffered, announced ClientHello size or None) -> None
HelloOverflow = Callable[[str, str, int, int | None], None]


class BoundedClientTLSLayer(tls.ClientTLSLayer):
    """mitmproxy's ClientTLSLayer, parsing the ClientHello once (when complete) and at most `max_bytes`
    of it. Everything after the ClientHello is mitmproxy's and OpenSSL's, unchanged."""

    def __init__(self, context, max_bytes: int, overflow: HelloOverflow | None,
                 abort_later: Callable[[str, float], object] | None = None) -> None:
        super().__init__(context)
        self.max_bytes = max_bytes
        self.overflow = overflow
        self.abort_later = abort_later
        self.scan = HelloScan()
        self.refused = False

    def receive_handshake_data(self, data: bytes) -> layer.CommandGenerator[tuple[bool, str | None]]:
        if self.client_hello_parsed or self.is_dtls:
            return (yield from super().receive_handshake_data(data))
        if self.refused:  # bytes that were on their way when we closed
            return False, None
        self.recv_buffer.extend(data)
        scan = self.scan
        scan.feed(self.recv_buffer)
        if (scan.announced is not None and scan.announced > self.max_bytes) or scan.offset > self.max_bytes:
            return (yield from self._refuse())
        if scan.invalid:  # what mitmproxy's parser says too, without its hex dump of the whole buffer
            return False, f"Cannot parse ClientHello: not a TLS handshake record at byte {scan.offset}"
        if scan.complete:
            self.recv_buffer = scan.reframed(self.recv_buffer)
            self.scan = HelloScan()  # release the copy
            return (yield from super().receive_handshake_data(b""))  # one parse, of a bounded buffer
        return False, None

    def _refuse(self) -> layer.CommandGenerator[tuple[bool, str | None]]:
        self.refused = True
        client = self.context.client
        source = str(client.peername[0]) if client.peername else "unknown"
        buffered = len(self.recv_buffer)
        self.recv_buffer = bytearray()  # release the memory now
        if self.overflow is not None:
            self.overflow(client.id, source, buffered, self.scan.announced)
        yield commands.SendData(self.tunnel_connection, ALERT_ILLEGAL_PARAMETER)
        if self.abort_later is not None:
            self.abort_later(client.id, ALERT_GRACE)
        announced = f"announced {self.scan.announced} bytes, " if self.scan.announced is not None else ""
        return False, (f"ClientHello larger than {self.max_bytes} bytes ({announced}{buffered} buffered; "
                       f"limits.max_client_hello_bytes); connection closed")

    def on_handshake_error(self, err: str) -> layer.CommandGenerator[None]:
        if not self.refused:
            yield from super().on_handshake_error(err)
            return
        # not mitmproxy's "the client may not trust the proxy's certificate" hint: we refused it
        yield commands.Log(f"Client TLS handshake refused. {err}", level=logging.INFO)
        yield from tls.TLSLayer.on_handshake_error(self, err)  # TlsFailedClientHook, close
        self.event_to_child = self.errored  # type: ignore[method-assign]

    def receive_data(self, data: bytes) -> layer.CommandGenerator[None]:
        if self.refused:  # no TLS state exists: swallow what arrives before the close takes effect
            return
        yield from super().receive_data(data)


def client_tls_layer(context, rt: Runtime) -> tls.ClientTLSLayer:
    """The gateway's ClientTLSLayer, for every place it builds one (layers/next_layer.py, http_limits.py)."""
    limits = rt.config.limits

    def overflow(client_id: str, source: str, buffered: int, announced: int | None) -> None:
        state = rt.conns.get(client_id)
        what = f"announced {announced} bytes, " if announced is not None else ""
        message = (f"TLS ClientHello larger than {limits.max_client_hello_bytes} bytes "
                   f"(limits.max_client_hello_bytes; {what}{buffered} bytes of records buffered); "
                   f"closed with a TLS alert")
        logger.info("closing connection %s from %s: %s", client_id, source, message)
        if rt.limit_audit is None:
            logger.error("connection %s from %s: no limit audit to record %s", client_id, source,
                         Reason.CLIENT_HELLO_TOO_LARGE)
            return
        rt.limit_audit.record(Reason.CLIENT_HELLO_TOO_LARGE, source, message,
                              sandbox_id=state.sandbox_id if state is not None else None,
                              extra={"egressgate.limit": "max_client_hello_bytes"})

    def abort_later(client_id: str, delay: float) -> object:
        later = rt.abort_connection_later
        return later(client_id, delay) if later is not None else False

    return BoundedClientTLSLayer(context, limits.max_client_hello_bytes, overflow, abort_later)
