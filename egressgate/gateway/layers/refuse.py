"""Refusing a connection before any HTTP layer exists: the deny contract as raw bytes, then the close.

Used where the gateway has decided "no" and there is nothing to parse a request with: a connection over
the per-source limit (connguard.py), non-HTTP bytes in a tunnel no tcp rule allows (layers/next_layer.py), and the
transparent listener's refusals of non-HTTP bytes or a CONNECT (transparent.py).
"""

from __future__ import annotations

from mitmproxy.proxy import commands, events, layer


def looks_like_http(data: bytes) -> bool:
    line_end = data.find(b"\n")
    space = data.find(b" ")
    return len(data) >= 3 and data[:3].isalpha() and space != -1 and (line_end == -1 or space < line_end)


class RefuseLayer(layer.Layer):
    """Answers with the deny contract and closes; forwards nothing."""

    def __init__(self, context, payload: bytes, at_first_bytes: bool = False) -> None:
        """`at_first_bytes`: answer when the client first sends (a refused tunnel whose layer was chosen
        as it opened, http_layer.py), not at the start; a client that closes first gets the close."""
        super().__init__(context)
        self.payload = payload
        self.done = False
        self.answer_on = events.DataReceived if at_first_bytes else events.Start | events.DataReceived

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if not self.done and isinstance(event, events.ConnectionClosed) and event.connection is self.context.client:
            self.done = True
            yield commands.CloseConnection(self.context.client)
            if self.context.server.connected:
                yield commands.CloseConnection(self.context.server)
        if not self.done and isinstance(event, self.answer_on):
            self.done = True
            yield commands.SendData(self.context.client, self.payload)
            yield commands.CloseConnection(self.context.client)
            if self.context.server.connected:
                yield commands.CloseConnection(self.context.server)
