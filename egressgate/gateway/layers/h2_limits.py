"""HTTP/2 header blocks with a size bound, on both sides of the gateway.

h2 (4.4) buffers a header block split over CONTINUATION frames until END_HEADERS, bounded only by
frame count (64) times the frame size mitmproxy advertises (128 KiB): ~8 MiB of compressed header
block per connection before anything is decoded (the CONTINUATION-flood class, CVE-2024-27316). The
decoded header list is already bounded at 64 KiB (h2's default `max_header_list_size`, which
mitmproxy keeps), and an HPACK block larger than that cannot decode to less (HPACK never expands a
header beyond name + value + 32 bytes of accounting), so the *compressed* block is bounded the same:
HEADER_BLOCK_MAX. Beyond it the peer gets a connection error (GOAWAY) and the buffered frames are
released; a header list any real client sends is far smaller.

The upstream side also sends request heads through `te_for_upstream` (layers/hop_by_hop.py): only `te: trailers`
goes out on HTTP/2, whatever version the client spoke.

A stream answered before its request body was read (early_answer.py) ends with the answer while the
client may still be sending: its DATA is acknowledged (flow control) and discarded, never handed on, up
to the HTTP/1 lingering bounds (LINGER_MAX_BYTES / LINGER_SECONDS, http1_framing.py); past them the stream
is reset with NO_ERROR (RFC 9113 8.1: a complete response, the client may stop sending). It is not reset
at once: a client that sends the whole body before reading (httpx/httpcore) treats a reset during its
upload as an error and would never read the answer, while curl reads as it sends and stops at the answer.
"""

from __future__ import annotations

import time

import h2.events
import h2.stream
from h2.errors import ErrorCodes
from h2.exceptions import ProtocolError
from h2.frame_buffer import FrameBuffer
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers.http._events import RequestHeaders, ResponseEndOfMessage
from mitmproxy.proxy.layers.http._http2 import Http2Client, Http2Server

from egressgate.gateway.layers.hop_by_hop import te_for_upstream
from egressgate.gateway.layers.http1_framing import LINGER_MAX_BYTES, LINGER_SECONDS

HEADER_BLOCK_MAX = 64 * 1024  # = h2's DEFAULT_MAX_HEADER_LIST_SIZE, the decoded bound


class BoundedFrameBuffer(FrameBuffer):
    def _update_header_buffer(self, f):
        frame = super()._update_header_buffer(f)
        if self._headers_buffer and sum(len(x.data) for x in self._headers_buffer) > HEADER_BLOCK_MAX:
            self._headers_buffer = []  # release now
            raise ProtocolError(f"header block larger than {HEADER_BLOCK_MAX} bytes")
        return frame


def _bound(conn: Http2Server | Http2Client, server: bool) -> None:
    """Swap h2's frame buffer before any byte arrived (h2 offers no setting for it)."""
    old = conn.h2_conn.incoming_buffer
    assert not old._data and not old._headers_buffer
    new = BoundedFrameBuffer(server=server)
    new.max_frame_size = old.max_frame_size
    conn.h2_conn.incoming_buffer = new


class GatewayHttp2Server(Http2Server):
    def __init__(self, context) -> None:
        super().__init__(context)
        _bound(self, server=True)
        self._draining: dict[int, list] = {}  # stream id -> [bytes discarded, monotonic start]

    def _handle_event(self, event: events.Event):
        """A plain function (no generator frame per event): only an answer's end needs a look."""
        if isinstance(event, ResponseEndOfMessage):
            return self._end_answer(event)
        return super()._handle_event(event)

    def _end_answer(self, event: ResponseEndOfMessage) -> layer.CommandGenerator[None]:
        stream = self.h2_conn.streams.get(event.stream_id)
        early = stream is not None and stream.state_machine.state is h2.stream.StreamState.OPEN
        yield from super()._handle_event(event)
        if early:  # the request side is still open: answered before its body (module docstring)
            self._draining[event.stream_id] = [0, time.monotonic()]

    def handle_h2_event(self, event: h2.events.Event) -> layer.CommandGenerator[bool]:
        if self._draining and isinstance(event, (h2.events.DataReceived, h2.events.StreamEnded,
                                                 h2.events.StreamReset)):
            drain = self._draining.get(event.stream_id)
            if drain is not None:
                if not isinstance(event, h2.events.DataReceived):
                    del self._draining[event.stream_id]
                    self.streams.pop(event.stream_id, None)
                    return False
                self.h2_conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                drain[0] += event.flow_controlled_length
                if drain[0] > LINGER_MAX_BYTES or time.monotonic() - drain[1] > LINGER_SECONDS:
                    del self._draining[event.stream_id]
                    self.streams.pop(event.stream_id, None)
                    if not self.is_closed(event.stream_id):
                        self.h2_conn.reset_stream(event.stream_id, ErrorCodes.NO_ERROR)
                return False
        return (yield from super().handle_h2_event(event))


class GatewayHttp2Client(Http2Client):
    def __init__(self, context) -> None:
        super().__init__(context)
        _bound(self, server=False)

    def _handle_event2(self, event: events.Event) -> layer.CommandGenerator[None]:
        """Request heads go out with at most `te: trailers` (layers/hop_by_hop.py: what the upstream hop allows)."""
        if isinstance(event, RequestHeaders):
            event = te_for_upstream(event, http2=True)
        yield from super()._handle_event2(event)
