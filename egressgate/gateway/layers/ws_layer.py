"""Every byte of every WebSocket frame gets the gateway's checks (mitmproxy's WebsocketLayer, guarded).

Why an override: mitmproxy 12's `WebsocketLayer.relay_messages` calls an addon hook only for a complete
data message (`websocket_message`, after FIN). Everything else passes without a hook: Ping and Pong
payloads and the Close code+reason are relayed as they are (and logged with their payload), and the
fragments of a message are appended to an unbounded buffer (`frame_buf`) until a FIN that may never
come. So an upstream echoing the injected credential in a Pong or a Close reason reached the sandbox,
control frames were neither counted nor scanned for phantoms, and 299 x 1 MiB continuation frames
without FIN held 300 MB per connection without ever meeting the budget.

The narrowest point that sees all of it is the layer's own event loop, so `GuardedWebsocketLayer`
overrides `relay_messages` (and nothing else), keeping mitmproxy's relay logic and adding:

* `websocket_wire` (hook): the size of every read from either side, *before* it is parsed — frame
  headers, masks, data fragments and control payloads alike, as they arrive. Budgets counts it (a read
  that would cross `outbound_bytes_max` is refused unparsed, so no part of it goes upstream).
* `websocket_control` (hook): each Ping, Pong and Close (payload / reason bytes, code) before it is
  relayed. Credentials scans client frames for phantoms and scrubs server frames on credentialed routes.
* a per-direction message buffer bounded by `websocket.max_message_bytes` (gateway config): the
  fragment that would pass it closes the connection (1009) and the buffer is released. With
  permessage-deflate, inflation is capped at the same limit (`_BoundedDeflate`): a small compressed
  frame cannot make the gateway build a huge message before the check sees it.
* after every hook (wire, control, message): a refusal set by an addon (`refuse`) or a killed flow
  (FailClosed) closes both sides with a Close frame naming the reason code, then `websocket_end` runs
  (record.py writes the session's record). mitmproxy itself ignores `flow.kill()` on a live websocket.
  The sandbox's side gets a bounded lingering close (`_lingering`), so a sandbox that is still sending
  reads the Close instead of a connection reset.
* control payloads are logged by size only (a payload can hold a credential; logs never carry one).

The layer is created by mitmproxy's HTTP layer on a 101 (`websocket.WebsocketLayer(...)`, a module
attribute lookup), not by next_layer, so `install()` (called by the NextLayer addon when it loads) points
that attribute at this class; every flow it guards is marked, and NextLayer's `websocket_start` aborts a
websocket that is not marked (fail closed if a mitmproxy upgrade bypasses the override).
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass
from typing import ClassVar

import wsproto.events
import wsproto.extensions
from mitmproxy import flow as mitm_flow
from mitmproxy import http, websocket
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.commands import StartHook
from mitmproxy.proxy.layers import websocket as mitm_ws
from mitmproxy.proxy.utils import expect
from wsproto import ConnectionState
from wsproto.frame_protocol import CloseReason, Opcode

from egressgate.gateway.shared.context import ensure_flow_state
from egressgate.gateway.shared.flowtypes import WsRefusal
from egressgate.policy.reasons import Reason

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
CONTROL_MAX = 125  # RFC 6455 5.5: a control frame's payload
LINGER_MAX_BYTES = 4 * 1024 * 1024  # after a refusal: discard at most this much from the sandbox ...
LINGER_SECONDS = 2.0  # ... for at most this long, waiting for its Close (see _lingering)
POLICY_VIOLATION = int(CloseReason.POLICY_VIOLATION)  # 1008
MESSAGE_TOO_BIG = int(CloseReason.MESSAGE_TOO_BIG)  # 1009
INTERNAL_ERROR = int(CloseReason.INTERNAL_ERROR)  # 1011


def refuse(flow: http.HTTPFlow, reason: Reason, code: int, message: str, detail: str | None = None) -> None:
    """Ask the layer to close this websocket after the current hook (the first refusal wins)."""
    fs = ensure_flow_state(flow)
    if fs.ws_refusal is None:
        fs.ws_refusal = WsRefusal(reason, code, message, detail)


def refusal_of(flow: http.HTTPFlow) -> WsRefusal | None:
    return ensure_flow_state(flow).ws_refusal


def guarded(flow: http.HTTPFlow) -> bool:
    """True once this flow's frames run through GuardedWebsocketLayer (next_layer.py aborts one that does not)."""
    return ensure_flow_state(flow).ws_guarded


@dataclass(slots=True)
class WireChunk:
    """One read from a peer, before parsing: `size` bytes of frames (any kind, any state)."""

    flow: http.HTTPFlow
    from_client: bool
    size: int


@dataclass(slots=True)
class ControlFrame:
    """A Ping, Pong or Close about to be relayed. Addons may replace `payload` (for a Close: the
    reason, UTF-8); the code of a Close is kept. It is relayed as the addons leave it."""

    flow: http.HTTPFlow
    from_client: bool
    kind: str  # "ping" | "pong" | "close"
    payload: bytes
    code: int | None = None  # Close only


# mitmproxy hooks take exactly one argument: the flow travels inside it (FailClosed refuses its flow).
@dataclass
class WebsocketWireHook(StartHook):
    """Bytes received on a websocket from the client or the server, before they are parsed."""

    chunk: WireChunk


@dataclass
class WebsocketControlHook(StartHook):
    """A Ping, Pong or Close frame received from the client or the server, before it is relayed."""

    frame: ControlFrame


class _MessageBuffer:
    """The fragments of the message being received from one peer. Chunks are kept as a list (no
    quadratic re-concatenation); `frame_lengths` lets mitmproxy's Fragmentizer keep the framing."""

    __slots__ = ("chunks", "frame_lengths", "size")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.frame_lengths: list[int] = [0]
        self.size = 0

    def add(self, data: bytes, frame_finished: bool) -> None:
        self.chunks.append(data)
        self.frame_lengths[-1] += len(data)
        self.size += len(data)
        if frame_finished:
            self.frame_lengths.append(0)

    def take(self) -> tuple[bytes, list[int]]:
        content, lengths = b"".join(self.chunks), self.frame_lengths
        if len(lengths) > 1 and lengths[-1] == 0:
            lengths = lengths[:-1]  # the FIN frame closed the last entry
        self.clear()
        return content, lengths

    def clear(self) -> None:
        self.chunks = []
        self.frame_lengths = [0]
        self.size = 0


class _BoundedDeflate(wsproto.extensions.PerMessageDeflate):
    """permessage-deflate whose inflation per read is capped at the message limit + 1 byte.

    wsproto inflates each received piece of a compressed frame in one call without a bound: 64 KiB
    read from the wire (one mitmproxy read) could become ~64 MiB before the layer's size check saw it.
    Capped, a piece that would inflate past the limit yields limit + 1 bytes and the layer refuses the
    message (1009); the rest is never inflated."""

    max_output: int = DEFAULT_MAX_MESSAGE_BYTES + 1

    def frame_inbound_payload_data(self, proto, data: bytes) -> bytes | CloseReason:
        if not self._inbound_compressed or not self._inbound_is_compressible:
            return data
        assert self._decompressor is not None
        try:
            return self._decompressor.decompress(bytes(data), self.max_output)
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA

    def frame_inbound_complete(self, proto, fin: bool) -> bytes | CloseReason | None:
        if self._decompressor is not None and self._decompressor.unconsumed_tail:
            # capped above: that piece already passes the limit and the layer refuses the message.
            # wsproto's flush() would inflate the whole remaining input, unbounded.
            return b""
        return super().frame_inbound_complete(proto, fin)


def _killed(flow: http.HTTPFlow) -> bool:
    return flow.error is not None and flow.error.msg == mitm_flow.Error.KILLED_MESSAGE


class GuardedWebsocketLayer(mitm_ws.WebsocketLayer):
    """mitmproxy's WebsocketLayer with every frame counted, checked and bounded (module docstring)."""

    max_message_bytes: ClassVar[int] = DEFAULT_MAX_MESSAGE_BYTES

    @expect(events.Start)
    def start(self, event: events.Event) -> layer.CommandGenerator[None]:
        ensure_flow_state(self.flow).ws_guarded = True
        self._buffers = {True: _MessageBuffer(), False: _MessageBuffer()}
        yield from super().start(event)  # mitmproxy's start; it sets _handle_event = self.relay_messages
        # mitmproxy built a wsproto PerMessageDeflate per side (when negotiated): bound its inflation.
        # The instances are shared by wsproto's FrameProtocol and FrameDecoder, so retyping them is the
        # one place that reaches both without re-implementing mitmproxy's extension negotiation.
        for ws in (self.client_ws, self.server_ws):
            for ext in ws._proto.extensions:
                if type(ext) is wsproto.extensions.PerMessageDeflate:
                    ext.__class__ = _BoundedDeflate
                    ext.max_output = self.max_message_bytes + 1

    _handle_event = start

    def _stopped(self) -> bool:
        """After a hook: did an addon refuse, or FailClosed kill the flow?"""
        if refusal_of(self.flow) is None and _killed(self.flow):
            refuse(self.flow, Reason.INTERNAL_ERROR, INTERNAL_ERROR,
                   "The gateway failed while checking this websocket; it was closed.")
        return refusal_of(self.flow) is not None

    def _close_refused(self) -> layer.CommandGenerator[None]:
        """Close both peers with the refusal's code; release every buffer; end the flow (audited by
        the websocket_end hook). The server is closed at once; the sandbox gets a lingering close."""
        refusal = refusal_of(self.flow)
        assert refusal is not None and self.flow.websocket is not None
        for buf in self._buffers.values():
            buf.clear()
        del self.flow.websocket.messages[:]
        reason = refusal.close_reason()
        yield commands.Log(f"websocket closed by the gateway: {refusal.reason} ({refusal.detail or '-'})")
        ws_data = self.flow.websocket
        ws_data.timestamp_end = time.time()
        ws_data.closed_by_client = False
        ws_data.close_code = refusal.code
        ws_data.close_reason = reason
        for ws, text in ((self.server_ws, ""), (self.client_ws, reason)):
            if ws.state in {ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING}:
                yield ws.send2(wsproto.events.CloseConnection(code=refusal.code, reason=text))
        yield commands.CloseConnection(self.server_ws.conn)
        yield mitm_ws.WebsocketEndHook(self.flow)
        self.flow.live = False
        if self.client_ws.state is ConnectionState.LOCAL_CLOSING:  # the sandbox has not sent its Close yet
            self._linger_left = LINGER_MAX_BYTES
            self._linger_wakeup = commands.RequestWakeup(LINGER_SECONDS)
            self._handle_event = self._lingering
            yield self._linger_wakeup
        else:
            yield commands.CloseConnection(self.client_ws.conn)
            self._handle_event = self._finished

    @expect(events.DataReceived, events.ConnectionClosed, mitm_ws.WebSocketMessageInjected, events.Wakeup)
    def _lingering(self, event: events.Event) -> layer.CommandGenerator[None]:
        """After a refusal the sandbox may still be sending (it has not read our Close yet); closing
        the socket with its data unread would reset the connection and can destroy our Close before it
        is read (the lingering-close problem of HTTP servers). So its bytes are parsed only to find its
        Close and are otherwise discarded — nothing is relayed or kept — until that Close, EOF,
        LINGER_MAX_BYTES or LINGER_SECONDS, whichever comes first; then the connection is closed."""
        finished = isinstance(event, events.Wakeup) and event.command is self._linger_wakeup
        if isinstance(event, events.ConnectionClosed) and event.connection == self.context.client:
            finished = True
        elif isinstance(event, events.DataReceived) and event.connection == self.context.client:
            self._linger_left -= len(event.data)
            self.client_ws.receive_data(event.data)
            for ws_event in self.client_ws.events():
                if isinstance(ws_event, wsproto.events.CloseConnection):
                    finished = True
                    break
            finished = finished or self._linger_left <= 0
        if finished:
            yield commands.CloseConnection(self.client_ws.conn)
            self._handle_event = self._finished

    @expect(events.DataReceived, events.ConnectionClosed, mitm_ws.WebSocketMessageInjected, events.Wakeup)
    def _finished(self, _: events.Event) -> layer.CommandGenerator[None]:
        yield from ()  # like mitmproxy's `done`, but a late linger wakeup is expected here too

    @expect(events.DataReceived, events.ConnectionClosed, mitm_ws.WebSocketMessageInjected)
    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        assert self.flow.websocket  # satisfy type checker

        if isinstance(event, events.ConnectionEvent):
            from_client = event.connection == self.context.client
            injected = False
        elif isinstance(event, mitm_ws.WebSocketMessageInjected):
            from_client = event.message.from_client
            injected = True
        else:  # pragma: no cover
            raise AssertionError(f"Unexpected event: {event}")

        from_str = "client" if from_client else "server"
        src_ws, dst_ws = (self.client_ws, self.server_ws) if from_client else (self.server_ws, self.client_ws)
        buf = self._buffers[from_client]

        if isinstance(event, events.DataReceived):
            # counted before parsing: a refused read is never parsed, so nothing of it is relayed
            yield WebsocketWireHook(WireChunk(self.flow, from_client, len(event.data)))
            if self._stopped():
                yield from self._close_refused()
                return
            src_ws.receive_data(event.data)
        elif isinstance(event, events.ConnectionClosed):
            src_ws.receive_data(None)
        else:
            assert isinstance(event, mitm_ws.WebSocketMessageInjected)
            fragmentizer = mitm_ws.Fragmentizer([], event.message.type == Opcode.TEXT)
            src_ws._events.extend(fragmentizer(event.message.content))

        for ws_event in src_ws.events():
            if isinstance(ws_event, wsproto.events.Message):
                is_text = isinstance(ws_event.data, str)
                data = ws_event.data.encode() if is_text else bytes(ws_event.data)
                if buf.size + len(data) > self.max_message_bytes:
                    refuse(self.flow, Reason.MESSAGE_TOO_LARGE, MESSAGE_TOO_BIG,
                           f"A websocket message may not exceed {self.max_message_bytes} bytes.",
                           detail=f"from_{from_str}")
                    yield from self._close_refused()
                    return
                buf.add(data, ws_event.frame_finished or ws_event.message_finished)
                if ws_event.message_finished:
                    content, lengths = buf.take()
                    fragmentizer = mitm_ws.Fragmentizer([], is_text)
                    fragmentizer.fragment_lengths = lengths
                    message = websocket.WebSocketMessage(
                        Opcode.TEXT if is_text else Opcode.BINARY, from_client, content, injected=injected
                    )
                    self.flow.websocket.messages.append(message)
                    yield mitm_ws.WebsocketMessageHook(self.flow)
                    if self._stopped():
                        yield from self._close_refused()
                        return
                    if not message.dropped:
                        for msg in fragmentizer(message.content):
                            yield dst_ws.send2(msg)

            elif isinstance(ws_event, (wsproto.events.Ping, wsproto.events.Pong)):
                kind = "ping" if isinstance(ws_event, wsproto.events.Ping) else "pong"
                frame = ControlFrame(self.flow, from_client, kind, bytes(ws_event.payload))
                yield WebsocketControlHook(frame)
                if self._stopped():
                    yield from self._close_refused()
                    return
                # the payload is never logged: it may hold a credential (an upstream echoing it)
                yield commands.Log(f"Received WebSocket {kind} from {from_str} ({len(frame.payload)} bytes)",
                                   logging.DEBUG)
                payload = frame.payload[:CONTROL_MAX]  # a scrubbed payload may be longer; never invalid
                out = wsproto.events.Ping(payload) if kind == "ping" else wsproto.events.Pong(payload)
                yield dst_ws.send2(out)

            elif isinstance(ws_event, wsproto.events.CloseConnection):
                reason_bytes = (ws_event.reason or "").encode()
                frame = ControlFrame(self.flow, from_client, "close", reason_bytes, code=ws_event.code)
                yield WebsocketControlHook(frame)
                if self._stopped():
                    yield from self._close_refused()
                    return
                reason = frame.payload.decode("utf-8", errors="replace")
                close = wsproto.events.CloseConnection(code=ws_event.code, reason=reason)
                self.flow.websocket.timestamp_end = time.time()
                self.flow.websocket.closed_by_client = from_client
                self.flow.websocket.close_code = close.code
                self.flow.websocket.close_reason = close.reason

                for ws in [self.server_ws, self.client_ws]:
                    if ws.state in {ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING}:
                        # response == original event (as checked and scrubbed), so no need to differentiate
                        yield ws.send2(close)
                    yield commands.CloseConnection(ws.conn)
                for b in self._buffers.values():
                    b.clear()
                yield mitm_ws.WebsocketEndHook(self.flow)
                self.flow.live = False
                self._handle_event = self.done
                return
            else:  # pragma: no cover
                raise AssertionError(f"Unexpected WebSocket event: {ws_event}")


def install(max_message_bytes: int) -> None:
    """Make mitmproxy's HTTP layer create GuardedWebsocketLayer for every websocket (process-global,
    like mitmproxy.ctx: one gateway per process)."""
    GuardedWebsocketLayer.max_message_bytes = max_message_bytes
    mitm_ws.WebsocketLayer = GuardedWebsocketLayer  # type: ignore[misc]
