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
"""

from __future__ import annotations

import re

import h11
from mitmproxy import http
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import Http1Client, Http1Server
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import (
    ErrorCode,
    HttpEvent,
    RequestEndOfMessage,
    RequestTrailers,
    ResponseEndOfMessage,
    ResponseProtocolError,
    ResponseTrailers,
)
from mitmproxy.proxy.layers.http._http1 import make_error_response

TRAILER_SECTION_MAX = 64 * 1024
INFORMATIONAL_MAX = 16
_INFORMATIONAL = re.compile(rb"HTTP/1\.[01] (1(?!01)\d\d)(?:[ \r\n]|$)")


def _read_body(conn: Http1Server | Http1Client, event: events.Event, receive_trailers) -> layer.CommandGenerator[None]:
    """mitmproxy 12.3.1's `Http1Connection.read_body`, with trailers emitted instead of raising, the
    trailer section bounded, and a 400 for the client when its request body cannot be read."""
    assert conn.stream_id is not None
    while True:
        try:
            if isinstance(event, events.DataReceived):
                h11_event = conn.body_reader(conn.buf)
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
                yield commands.SendData(conn.conn, make_error_response(400, str(e)))  # the client sees why
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


class GatewayHttp1Server(Http1Server):
    """The client side of an HTTP/1 connection: reads request trailers, writes response trailers."""

    _response_trailers: http.Headers | None = None

    def read_body(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from _read_body(self, event, RequestTrailers)

    def send(self, event: HttpEvent) -> layer.CommandGenerator[None]:
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
        yield from super().send(event)


class GatewayHttp1Client(Http1Client):
    """The upstream side of an HTTP/1 connection: reads response trailers, swallows 1xx responses."""

    _informational = 0
    _refused = False

    def read_body(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from _read_body(self, event, ResponseTrailers)

    def read_headers(self, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived) and self.request is not None and self.stream_id is not None:
            while (match := _INFORMATIONAL.match(bytes(self.buf)[:16])) is not None:
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
