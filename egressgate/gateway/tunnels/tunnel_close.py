"""A relay inside a CONNECT tunnel forwards a half-close instead of turning it into a full close.

mitmproxy's HttpStream runs a CONNECT tunnel's child layer (the raw-TCP relay, `layers.TCPLayer`) in its
`passthrough` state and turns every `CloseTcpConnection(half_close=True)` the child yields into a full
`CloseConnection` ("to be consistent with half-closes ... always full close for now", mitmproxy 12.3.1).
For a raw-TCP tunnel that breaks every request/response protocol whose client ends its request with
`shutdown(SHUT_WR)`: the client's FIN made the relay close the upstream socket outright, so the reply the
upstream wrote after reading EOF was never read, and the client got b"". The transparent listener's raw
relay runs TCPLayer without an HTTP layer above it and always had half-closes; passthrough tunnels
hand their sockets to splice.py, which half-closes too.

Here, for a tunnel established by CONNECT (not a 101 upgrade, whose server connection belongs to the HTTP
client layer): a half-close of the upstream is forwarded as a half-close (the upstream sees the FIN and
can still answer), and so is a half-close of the client when the client connection carries only this
tunnel (HTTP/1; an HTTP/2 CONNECT stream shares its connection with other streams, so mitmproxy's stream
reset stays). Bytes still pass through the same TCPLayer and its `tcp_message` hook, so byte budgets and
the outcome record (written at `tcp_end`, once both sides are closed) are unchanged.
"""

from __future__ import annotations

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import HttpStream, SendHttp
from mitmproxy.proxy.layers.http._events import (
    ErrorCode,
    RequestData,
    RequestEndOfMessage,
    RequestProtocolError,
    ResponseData,
    ResponseEndOfMessage,
    ResponseProtocolError,
)
from mitmproxy.proxy.utils import expect


class HalfCloseTunnel(HttpStream):
    """HttpStream whose `passthrough` keeps half-closes of a CONNECT tunnel (see module doc)."""

    @expect(RequestData, RequestEndOfMessage, events.Event)
    def passthrough(self, event: events.Event) -> layer.CommandGenerator[None]:
        # mitmproxy 12.3.1's HttpStream.passthrough; changed: the CloseTcpConnection branch (marked)
        assert self.flow.response
        assert self.child_layer
        upgraded = self.flow.response.status_code == 101
        own_client = not upgraded and self.flow.request.http_version.startswith("HTTP/1")
        if isinstance(event, RequestData):
            event = events.DataReceived(self.context.client, event.data)
        elif isinstance(event, ResponseData):
            event = events.DataReceived(self.context.server, event.data)
        elif isinstance(event, RequestEndOfMessage):
            event = events.ConnectionClosed(self.context.client)
        elif isinstance(event, ResponseEndOfMessage):
            event = events.ConnectionClosed(self.context.server)

        for command in self.child_layer.handle_event(event):
            if isinstance(command, commands.SendData):
                if command.connection == self.context.client:
                    yield SendHttp(ResponseData(self.stream_id, command.data), self.context.client)
                elif command.connection == self.context.server and upgraded:
                    yield SendHttp(RequestData(self.stream_id, command.data), self.context.server)
                else:
                    yield command
            elif isinstance(command, commands.CloseConnection):
                half = isinstance(command, commands.CloseTcpConnection) and command.half_close
                if half and ((command.connection == self.context.server and not upgraded)
                             or (command.connection == self.context.client and own_client)):
                    yield command  # changed: the FIN is forwarded, the other direction stays open
                elif command.connection == self.context.client:
                    yield SendHttp(ResponseProtocolError(self.stream_id, "EOF", ErrorCode.PASSTHROUGH_CLOSE),
                                   self.context.client)
                elif command.connection == self.context.server and upgraded:
                    yield SendHttp(RequestProtocolError(self.stream_id, "EOF", ErrorCode.PASSTHROUGH_CLOSE),
                                   self.context.server)
                else:
                    if isinstance(command, commands.CloseTcpConnection):
                        command = commands.CloseConnection(command.connection)
                    yield command
            else:
                yield command
