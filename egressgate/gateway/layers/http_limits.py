"""HTTP/1 request heads with a size bound (`limits.max_header_bytes`).

mitmproxy's HTTP/1 server buffers request-head bytes until it sees the blank line, with no limit: one
connection sending 300 MB of a header line within the header deadline grew the gateway by 300 MB (and
left it too busy to stop). The deadline (connguard.py) bounds how *long* the gateway waits for a head;
this bounds how *much* it buffers meanwhile. Over the limit the client gets `431` with the deny contract
(reason `header_too_large`) and the connection is closed; the event is audited like a header timeout.

`BoundedHttpLayer` is the gateway's HTTP layer (http_layer.py: trailers, 1xx) whose HTTP/1 client side
is a `BoundedHttp1Server` (the gateway's HTTP/1 server with the bound; the layer keeps a pre-set client
connection: `connections.setdefault`). layers/next_layer.py builds every HTTP layer
through `http_layer()` / `explicit_http_proxy()`, so the bound holds on the proxy connection itself and
inside every tunnel, after TLS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import commands, events, layer, tunnel
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HTTPMode

from egressgate.gateway.layers.http1_framing import ABORT_GRACE, GatewayHttp1Server
from egressgate.gateway.layers.http_layer import GatewayHttpLayer
from egressgate.gateway.layers.tls_limits import client_tls_layer
from egressgate.gateway.shared.deny import gateway_deny, raw_deny
from egressgate.policy.reasons import Reason

if TYPE_CHECKING:
    from egressgate.gateway.shared.context import Runtime

# (client id, source address, buffered bytes) -> request id of the audit record
Overflow = Callable[[str, str, int], str]


class BoundedHttp1Server(GatewayHttp1Server):
    def __init__(self, context, max_bytes: int, overflow: Overflow | None,
                 abort_later: Callable[[str, float], object] | None = None) -> None:
        super().__init__(context)
        self.max_bytes = max_bytes
        self.overflow = overflow
        self.abort_later = abort_later

    def read_headers(self, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
        yield from super().read_headers(event)
        # still waiting for the blank line: everything buffered is head bytes
        if self.state == self.read_headers and len(self.buf) > self.max_bytes:
            client = self.context.client
            source = str(client.peername[0]) if client.peername else "unknown"
            request_id = self.overflow(client.id, source, len(self.buf)) if self.overflow else "-"
            self.buf.maybe_extract_at_most(len(self.buf))  # release the memory now
            self.state = self.refused
            decision = gateway_deny(
                Reason.HEADER_TOO_LARGE,
                f"The request head is larger than {self.max_bytes} bytes (limits.max_header_bytes); "
                f"send smaller headers.")
            yield commands.SendData(client, raw_deny(decision, request_id))
            yield commands.CloseConnection(client)
            if self.abort_later is not None:  # mitmproxy may fail to close it (GatewayHttp1Server.abort_later)
                self.abort_later(client.id, ABORT_GRACE)


class BoundedHttpLayer(GatewayHttpLayer):
    def __init__(self, context, mode: HTTPMode, rt: Runtime) -> None:
        super().__init__(context, mode)
        self.rt = rt
        self.max_response_head = rt.config.limits.max_header_bytes  # upstream heads: the same bound

    def _client_http1_server(self) -> BoundedHttp1Server:
        return BoundedHttp1Server(self.context.fork(), self.rt.config.limits.max_header_bytes,
                                  self.rt.header_overflow, self._abort_later)

    def _abort_later(self, client_id: str, delay: float) -> object:
        later = self.rt.abort_connection_later
        return later(client_id, delay) if later is not None else False


def http_layer(context, mode: HTTPMode, rt: Runtime) -> layer.Layer:
    return BoundedHttpLayer(context, mode, rt)


def explicit_http_proxy(context, data_client: bytes, rt: Runtime) -> layer.Layer:
    """mitmproxy's NextLayer._setup_explicit_http_proxy (regular mode, TCP), with the bounded layer."""
    stack = tunnel.LayerStack()
    if starts_like_tls_record(data_client):
        stack /= client_tls_layer(context, rt)
    assert not isinstance(context.layers[0], modes.HttpUpstreamProxy)  # we never run upstream mode
    stack /= http_layer(context, HTTPMode.regular, rt)
    return stack[0]
