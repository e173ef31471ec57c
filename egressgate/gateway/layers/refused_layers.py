"""Inside a CONNECT refused but accepted to deliver its deny (refused_tunnel.py says why and when): the
layer for the tunnel's bytes (`inner_layer`, NextLayer's choice) and the answer of every request in it
(`answer`, set by identity.py before any other stage). Shared by those two stages, so neither imports
the RefusedTunnel addon's module.
"""

from __future__ import annotations

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tls import HTTP_ALPNS

from egressgate.gateway.layers.http_limits import http_layer
from egressgate.gateway.layers.refuse import RefuseLayer, looks_like_http
from egressgate.gateway.layers.tls_limits import client_tls_layer
from egressgate.gateway.shared.context import ConnState, FlowState, Runtime
from egressgate.gateway.shared.deny import raw_deny


def answer(fs: FlowState, conn: ConnState) -> None:
    """A request inside a refused tunnel: the CONNECT's decision under the CONNECT's request id, already
    audited (record.py writes nothing; enforce.py answers it)."""
    assert conn.refusal is not None and conn.refused_target is not None
    fs.sandbox_id, fs.policy_name = conn.sandbox_id, conn.policy_name
    fs.host, fs.port = conn.refused_target
    fs.decision = conn.refusal
    fs.request_id = conn.refusal_id or fs.request_id
    fs.audited = True


def inner_layer(rt: Runtime, conn: ConnState, context, data: bytes) -> layer.Layer | None:
    """The layer inside a refused tunnel (None: wait for more bytes)."""
    assert conn.refusal is not None
    refusal = RefuseLayer(context, raw_deny(conn.refusal, conn.refusal_id or "-"))
    top = context.layers[-1] if context.layers else None
    if isinstance(top, layers.ClientTLSLayer):
        if context.client.alpn in HTTP_ALPNS:
            return http_layer(context, HTTPMode.transparent, rt)
        if len(data) < 3:
            return None
        return http_layer(context, HTTPMode.transparent, rt) if looks_like_http(data) else refusal
    if len(data) < 3:
        return None
    if starts_like_tls_record(data):
        server_tls = layers.ServerTLSLayer(context)  # never connects: nothing inside opens a server connection
        server_tls.child_layer = client_tls_layer(context, rt)
        return server_tls
    if looks_like_http(data):
        return http_layer(context, HTTPMode.transparent, rt)
    return refusal
