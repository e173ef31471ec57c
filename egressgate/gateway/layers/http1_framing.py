"""HTTP/1 framing mitmproxy 12.3.1 gets wrong, fixed on the two HTTP/1 connection layers the gateway uses.

mitmproxy's HTTP/1 layers (proxy/layers/http/_http1.py) have three gaps an agent or an upstream can hit:

* **Chunked trailers** (request or response): the body reader raises `NotImplementedError` when the
  last chunk carries trailer fields; the connection handler dies and the client hangs. Here they become
  `RequestTrailers` / `ResponseTrailers` events, exactly as mitmproxy's HTTP/2 layer emits them, so the
  hooks see `flow.request.trailers` / `flow.response.trailers` and the gateway's addons decide. A trailer
  section is bounded (TRAILER_SECTION_MAX, the same 64 KiB as the HTTP/2 header-list limit): beyond it
  the message is a protocol error, so a peer cannot make the gateway buffer an endless trailer block.
* **Sending trailers to an HTTP/1 peer**: `Http1Server`/`Http1Client.send` have no branch for them
  (an HTTP/2 upstream's trailers crash an HTTP/1 client's connection). Response trailers are written in
  the chunked terminator when the response to the client is chunked, and dropped otherwise (HTTP/1 has no
  other place for them). Request trailers are never sent upstream: the gateway refuses requests that carry
  them (trailers.py); reaching `send` with one means that refusal failed, so the upstream connection is
  closed instead (the upstream never sees the request complete).
* **1xx informational responses** (100 Continue, 102, 103 Early Hints): the upstream reader takes the
  first response head as the final one, so a `103` reaches the client as *the* response and the real one
  is dropped as "unexpected data" (the client hangs). They are swallowed here, as mitmproxy's HTTP/2 layer
  already does: the client gets the final response. Forwarding them is not worth it: they would bypass
  the response hooks (no scrubbing of a `Link` header echoing a credential), and mitmproxy already
  answers `Expect: 100-continue` itself. At most INFORMATIONAL_MAX are accepted per request; an upstream
  that keeps sending them gets a 502.
* **Unbounded framing buffers**: mitmproxy's HTTP/1 client buffers an upstream's unfinished response
  head, and h11's chunked reader (used directly, so h11's own `max_incomplete_event_size` never applies)
  an unfinished chunk-size line, without limit: an endless header or chunk-extension line grows the
  gateway by whatever the peer sends. A response head is bounded by `limits.max_header_bytes` (the
  request head's bound, http_limits.py), a chunk-size line (size + extensions, which no agent needs)
  by CHUNK_LINE_MAX, in both directions. Over a bound the buffered bytes are released at once, the
  peer's connection is closed, and the stream answers (http_layer.py): a request gets `400` with the
  deny contract (`invalid_request`), a response not yet started a `502 upstream_response_refused`, one
  already started is cut; the outcome record says which (`egressgate.request_refused` /
  `egressgate.response_refused`). Checked when the buffered bytes are still incomplete, so at most the
  bound plus one read is ever held.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import h11
from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import Http1Client, Http1Server
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import (
    ErrorCode,
    HttpEvent,
    RequestEndOfMessage,
    RequestHeaders,
    RequestProtocolError,
    RequestTrailers,
    ResponseEndOfMessage,
    ResponseProtocolError,
    ResponseTrailers,
)

from egressgate.gateway.layers.hop_by_hop import te_for_upstream
from egressgate.gateway.shared.credential_streams import refusal_body
from egressgate.gateway.shared.deny import REQUEST_ID_HEADER, deny_body, gateway_deny
from egressgate.policy.reasons import Reason

if TYPE_CHECKING:
    from h11._receivebuffer import ReceiveBuffer

TRAILER_SECTION_MAX = 64 * 1024
CHUNK_LINE_MAX = 4 * 1024  # one chunk-size line, extensions included
DEFAULT_RESPONSE_HEAD_MAX = 64 * 1024  # the default of limits.max_header_bytes
ABORT_GRACE = 1.0  # seconds a refused client connection has to close cleanly before it is aborted
# a request answered before its body was read (early_answer.py): how much of the body the gateway still
# reads and discards, and for how long, so that a client that sends it all before reading (requests,
# twine, http.client) gets to read the answer instead of a reset (a lingering close, as web servers do)
LINGER_MAX_BYTES = 64 * 1024 * 1024
LINGER_SECONDS = 10.0
INFORMATIONAL_MAX = 16
_INFORMATIONAL = re.compile(rb"HTTP/1\.[01] (1(?!01)\d\d)(?:[ \r\n]|$)")


class RefusedRequest(RequestProtocolError):
    """A request body whose framing the client side refused (`reason`); the stream answers it."""

    def __init__(self, stream_id: int, message: str, reason: str) -> None:
        super().__init__(stream_id, message, ErrorCode.GENERIC_CLIENT_ERROR)
        self.reason = reason


class Refusal(ResponseProtocolError):
    """What the client gets for a refused request (400, deny contract) or upstream response (502,
    `upstream_response_refused`); `request_id` is filled in by the stream, which knows the flow."""

    def __init__(self, stream_id: int, message: str, reason: str, status: int = 502) -> None:
        super().__init__(stream_id, message, ErrorCode.GENERIC_SERVER_ERROR)
        self.reason = reason
        self.status = status
        self.request_id = "-"

    def raw(self) -> bytes:
        if self.status == 502:
            body = refusal_body(self.request_id, self.reason, self.message)
            extra = ""
        else:
            body = deny_body(gateway_deny(Reason.INVALID_REQUEST, self.message, detail=self.reason),
                             self.request_id)
            extra = "X-Egressgate-Decision: deny\r\n"
        head = (f"HTTP/1.1 {self.status} {'Bad Gateway' if self.status == 502 else 'Bad Request'}\r\n"
                f"Content-Type: application/json\r\n{extra}{REQUEST_ID_HEADER}: {self.request_id}\r\n"
                f"Cache-Control: no-store\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        return head.encode() + body


def _chunk_line_refusal(conn: Http1Server | Http1Client) -> layer.CommandGenerator[None]:
    """An unfinished chunk-size line over CHUNK_LINE_MAX: drop it, stop reading, tell the stream."""
    assert conn.stream_id is not None
    size = len(conn.buf)
    conn.buf.maybe_extract_at_most(size)  # release the memory now
    conn.state = conn.refused
    message = (f"A chunk-size line (with chunk extensions) longer than {CHUNK_LINE_MAX} bytes was refused "
               f"({size} bytes unfinished); send chunks without extensions.")
    if isinstance(conn, Http1Client):
        yield commands.CloseConnection(conn.conn)
        yield ReceiveHttp(Refusal(conn.stream_id, message, "chunk_line_too_large"))
        return
    # the stream answers (400 with its request id) and closes, possibly later: it may be waiting for a
    # hook (events to it are queued meanwhile); until then nothing more is read into the buffer
    yield ReceiveHttp(RefusedRequest(conn.stream_id, message, "chunk_line_too_large"))
    if conn.response is not None and conn.conn.state & ConnectionState.CAN_WRITE:
        yield commands.CloseConnection(conn.conn)  # answered early (a deny): no stream left to answer


def _body_refusal(conn: Http1Server, error: h11.ProtocolError, closed: bool) -> layer.CommandGenerator[None]:
    """A request body that cannot be read (bad framing, or the connection ended before the body did):
    the stream answers `400` with the deny contract and its request id while the client can still read
    (GatewayHttpStream), never mitmproxy's HTML page; a connection the gateway itself closed gets nothing."""
    assert conn.stream_id is not None
    conn.buf.maybe_extract_at_most(len(conn.buf))  # release the memory now
    conn.state = conn.refused
    if closed:
        message = f"The connection ended before the request body did ({error}); send the whole body."
    else:
        message = f"The request body's framing is invalid ({error}), so the request was refused."
    yield ReceiveHttp(RefusedRequest(conn.stream_id, message, "body_incomplete" if closed else "body_framing"))
    abort_later = getattr(conn, "abort_later", None)
    if abort_later is not None:  # the stream answers and closes; should it be gone, nothing else would
        abort_later(conn.conn.id, ABORT_GRACE)


def _read_body(conn: Http1Server | Http1Client, event: events.Event, receive_trailers) -> layer.CommandGenerator[None]:
    """mitmproxy 12.3.1's `Http1Connection.read_body`, with trailers emitted instead of raising, the
    trailer section bounded, and a 400 (deny contract) for the client when its request body cannot be read."""
    assert conn.stream_id is not None
    while True:
        try:
            if isinstance(event, events.DataReceived):
                h11_event = conn.body_reader(conn.buf)
                if h11_event is None and len(conn.buf) > CHUNK_LINE_MAX and not getattr(
                        conn.body_reader, "_reading_trailer", False):
                    # the only reader that leaves bytes unconsumed is the chunked one, waiting for a line
                    yield from _chunk_line_refusal(conn)
                    return
            elif isinstance(event, events.ConnectionClosed):
                h11_event = conn.body_reader.read_eof()
            else:
                raise AssertionError(f"Unexpected event: {event}")
            if h11_event is None and getattr(conn.body_reader, "_reading_trailer", False):
                pending = len(conn.buf)  # an incomplete trailer section is buffered here: bound it
            elif isinstance(h11_event, h11.EndOfMessage):
                pending = sum(len(name) + len(value) + 4 for name, value in h11_event.headers)
            else:
                pending = 0
            if pending > TRAILER_SECTION_MAX:
                raise h11.RemoteProtocolError(f"trailer section larger than {TRAILER_SECTION_MAX} bytes")
        except h11.ProtocolError as e:
            if isinstance(conn, Http1Server) and conn.response is None:
                yield from _body_refusal(conn, e, closed=isinstance(event, events.ConnectionClosed))
                return
            yield commands.CloseConnection(conn.conn)
            yield ReceiveHttp(conn.ReceiveProtocolError(conn.stream_id, f"HTTP/1 protocol error: {e}",
                                                        code=conn.ReceiveProtocolError.code))
            return
        if h11_event is None:
            return
        if isinstance(h11_event, h11.Data):
            data = bytes(h11_event.data)
            if data:
                yield ReceiveHttp(conn.ReceiveData(conn.stream_id, data))
        elif isinstance(h11_event, h11.EndOfMessage):
            assert conn.request
            if h11_event.headers:
                yield ReceiveHttp(receive_trailers(conn.stream_id, http.Headers(list(h11_event.headers))))
            if conn.request.data.method.upper() != b"CONNECT":
                yield ReceiveHttp(conn.ReceiveEndOfMessage(conn.stream_id))
            is_request = isinstance(conn, Http1Server)
            yield from conn.mark_done(request=is_request, response=not is_request)
            return


class _Refusable:
    buf: ReceiveBuffer

    def refused(self, event: events.Event) -> layer.CommandGenerator[None]:
        """Terminal state of a refused connection: whatever still arrives is dropped, never buffered
        (`_handle_event` appends it to the buffer before calling the state)."""
        if self.buf:
            self.buf.maybe_extract_at_most(len(self.buf))
        yield from ()


class GatewayHttp1Server(_Refusable, Http1Server):
    """The client side of an HTTP/1 connection: reads request trailers, writes response trailers, and
    answers a refused request or upstream response with the deny contract."""

    _response_trailers: http.Headers | None = None
    _lingered = 0  # body bytes discarded after an early answer
    # aborts a client connection and its upstreams by client id in n seconds
    # (master.abort_connection_later); set by http_limits.py. mitmproxy can lose a CloseConnection:
    # when it cancels a connection's reader task while that task waits for its event lock (a hostile
    # peer that never stops sending makes this likely), the task ends without closing the socket,
    # which then stays open, unread, for good.
    abort_later: Callable[[str, float], object] | None = None

    def read_body(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from _read_body(self, event, RequestTrailers)

    def send(self, event: HttpEvent) -> layer.CommandGenerator[None]:
        if isinstance(event, Refusal):
            if not self.conn.state & ConnectionState.CAN_WRITE:
                return
            if self.response is None:  # nothing of a response went out yet: answer; else cut
                yield commands.SendData(self.conn, event.raw())
            self.state = self.refused
            yield commands.CloseConnection(self.conn)
            if self.abort_later is not None:  # whatever did not close by then (see `abort_later`) is cut
                self.abort_later(self.conn.id, ABORT_GRACE)
            return
        if isinstance(event, ResponseTrailers):
            self._response_trailers = event.trailers  # written with the terminating chunk
            return
        if isinstance(event, ResponseEndOfMessage) and self._response_trailers is not None:
            trailers, self._response_trailers = self._response_trailers, None
            assert self.request and self.response
            chunked = "chunked" in self.response.headers.get("transfer-encoding", "").lower()
            if chunked and self.request.method.upper() != "HEAD":
                yield commands.SendData(self.conn, b"0\r\n" + bytes(trailers) + b"\r\n")
                yield from self.mark_done(response=True)
                return
            yield commands.Log("dropping response trailers: the response to this HTTP/1 client is not chunked")
        if isinstance(event, ResponseEndOfMessage) and not self.request_done and self.state == self.read_body:
            # answered before the request body was read (early_answer.py): the stream is gone, the rest
            # of the body is never parsed; the connection ends with a lingering close
            yield from super().send(event)
            yield from self._linger()
            return
        yield from super().send(event)

    def _linger(self) -> layer.CommandGenerator[None]:
        """FIN after the answer, then read and discard what the client still sends until it closes, up to
        LINGER_MAX_BYTES / LINGER_SECONDS; then the connection is closed (aborted after the time). A
        client that waits for the body to go out before reading (requests, http.client) reads the answer;
        one that reads while it sends (curl) stops sending at the answer. Closing at once would reset the
        connection with the client's body still arriving, and the reset can discard the unread answer."""
        self.state = self.lingering
        self._lingered = len(self.buf)
        self.buf.maybe_extract_at_most(len(self.buf))
        yield commands.CloseTcpConnection(self.conn, half_close=True)
        if self.abort_later is not None:
            self.abort_later(self.conn.id, LINGER_SECONDS)

    def lingering(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived):
            size = len(self.buf)
            self.buf.maybe_extract_at_most(size)  # discarded, never parsed
            self._lingered += size
            if self._lingered > LINGER_MAX_BYTES:
                self.state = self.refused
                yield commands.CloseConnection(self.conn)
                if self.abort_later is not None:
                    # inside a CONNECT tunnel mitmproxy turns this close into an error for the outer HTTP/1
                    # layer, which drops it on a connection that can no longer write (our FIN): abort
                    self.abort_later(self.conn.id, 0.0)
        elif isinstance(event, events.ConnectionClosed):
            self.state = self.refused
            if self.conn.state is not ConnectionState.CLOSED:
                yield commands.CloseConnection(self.conn)


class GatewayHttp1Client(_Refusable, Http1Client):
    """The upstream side of an HTTP/1 connection: reads response trailers, swallows 1xx responses,
    bounds the response head."""

    _informational = 0
    _refused = False

    def __init__(self, context, max_head_bytes: int = DEFAULT_RESPONSE_HEAD_MAX) -> None:
        super().__init__(context)
        self.max_head_bytes = max_head_bytes

    def read_body(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from _read_body(self, event, ResponseTrailers)

    def read_headers(self, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
        yield from self._read_headers(event)
        # still waiting for the blank line (of a 1xx or the final head): everything buffered is head
        if self.state == self.read_headers and len(self.buf) > self.max_head_bytes and self.stream_id is not None:
            size = len(self.buf)
            self.buf.maybe_extract_at_most(size)  # release the memory now
            self.state = self.refused
            yield commands.CloseConnection(self.conn)
            yield ReceiveHttp(Refusal(
                self.stream_id, f"The upstream's response head was larger than {self.max_head_bytes} bytes "
                f"(limits.max_header_bytes; {size} buffered), so it was refused.", "response_header_too_large"))

    def _read_headers(self, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived) and self.request is not None and self.stream_id is not None:
            # the first 16 bytes only: bytes(self.buf) copied the whole buffer on every read, quadratic
            # in a head an upstream trickles in (h11's ReceiveBuffer keeps its bytes in `_data`)
            while (match := _INFORMATIONAL.match(self.buf._data[:16])) is not None:
                if self.buf.maybe_extract_lines() is None:
                    return  # the rest of the informational head has not arrived yet
                self._informational += 1
                if self._informational > INFORMATIONAL_MAX:
                    yield commands.CloseConnection(self.conn)
                    yield ReceiveHttp(ResponseProtocolError(
                        self.stream_id, f"more than {INFORMATIONAL_MAX} informational (1xx) responses",
                        ErrorCode.GENERIC_SERVER_ERROR))
                    return
                yield commands.Log(f"swallowing HTTP/1 informational response {match.group(1).decode()}")
            if not self.buf:
                return
        yield from super().read_headers(event)

    def mark_done(self, *, request: bool = False, response: bool = False) -> layer.CommandGenerator[None]:
        if response:
            self._informational = 0  # the count is per request on a keep-alive connection
        yield from super().mark_done(request=request, response=response)

    def send(self, event: HttpEvent) -> layer.CommandGenerator[None]:
        if isinstance(event, RequestHeaders):  # te is per hop on HTTP/1: never forwarded (layers/hop_by_hop.py)
            event = te_for_upstream(event, http2=False)
        if isinstance(event, RequestTrailers):
            # unreachable while trailers.py refuses every request with trailers; if that ever fails, the
            # upstream must not see a complete request that skipped the checks
            yield commands.Log("request trailers reached the upstream side; closing the upstream connection")
            self._refused = True
            yield commands.CloseConnection(self.conn)
            return
        if self._refused and isinstance(event, RequestEndOfMessage):
            return  # never the terminating chunk of a refused request
        yield from super().send(event)
