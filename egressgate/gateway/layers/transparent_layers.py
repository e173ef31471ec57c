"""The layers of a transparent connection (NextLayer's choice for the transparent listener): the root
layer that opens nothing (`TransparentRoot`, `install`), the layer picked from the connection's first
bytes (`root_layer`: TLS intercepted or peeked for a passthrough SNI, HTTP, a refused proxy form, raw TCP
under a `tcp` rule, a server-first protocol), and the layer inside a refused connection's TLS
(`refused_inner_layer`). transparent.py's docstring says why the listener works this way; its addon,
Transparent, decides the names.
"""

from __future__ import annotations

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import commands, events, layer, layers, mode_servers
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tls import HTTP_ALPNS

from egressgate.gateway.layers.http_limits import http_layer
from egressgate.gateway.layers.refuse import RefuseLayer, looks_like_http
from egressgate.gateway.layers.tls_limits import client_tls_layer
from egressgate.gateway.shared import transparent_decide as td
from egressgate.gateway.shared.context import ConnState, Runtime, new_request_id
from egressgate.gateway.shared.deny import gateway_deny, raw_deny
from egressgate.gateway.shared.history import refuse_unrecorded
from egressgate.gateway.shared.sources import NOT_A_PROXY
from egressgate.gateway.tunnels.passthrough_peek import SniPeekLayer
from egressgate.policy.reasons import Reason

# An HTTP method still arriving (no space yet): wait for more bytes instead of judging it as raw TCP.
_METHOD_MAX = 24
# Client silence after which a connection may be a server-first protocol (TransparentRoot).
SERVER_FIRST_AFTER = 1.0


class _TransparentNext(layer.NextLayer):
    """The root's next-layer slot; `client_silent` is set when the client sent nothing for
    SERVER_FIRST_AFTER seconds (the next_layer hook is then asked once more, with no data)."""

    client_silent: bool = False


class TransparentRoot(layer.Layer):
    """Top layer of a transparent connection: hands the connection to the next-layer decision without
    opening any upstream connection.

    A server-first protocol (SMTP, MySQL, FTP) never sends the first byte, so the decision would wait
    for data until the header deadline. After SERVER_FIRST_AFTER seconds of client silence the root
    asks once more, with `client_silent` set: root_layer() then relays raw TCP if (and only if) a `tcp`
    rule allows the original IP:port; otherwise it keeps waiting for the client."""

    child: _TransparentNext
    wakeup: commands.RequestWakeup | None = None

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            self.child = _TransparentNext(self.context)
            yield from self.child.handle_event(event)
            self.wakeup = commands.RequestWakeup(SERVER_FIRST_AFTER)
            yield self.wakeup
        elif isinstance(event, events.Wakeup) and event.command is self.wakeup:
            self.wakeup = None
            if self.child.layer is None and not self.child.data_client():
                self.child.client_silent = True
                yield from self.child._ask()  # the next_layer hook, then the chosen layer's replay
        else:
            yield from self.child.handle_event(event)


def _make_top_layer(_instance, context) -> layer.Layer:
    return TransparentRoot(context)


def install() -> None:
    """Make mitmproxy's transparent listener start every connection on TransparentRoot (process-global,
    like mitmproxy.ctx: one gateway per process)."""
    mode_servers.TransparentInstance.make_top_layer = _make_top_layer  # type: ignore[method-assign]


def _fmt(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def root_layer(rt: Runtime, nextlayer: layer.NextLayer) -> layer.Layer | None:
    """The layer for a new transparent connection, from its first bytes (None: wait for more)."""
    context = nextlayer.context
    conn = rt.conn(context.client.id)
    if not conn.transparent:
        address = context.server.address  # SO_ORIGINAL_DST, set by mitmproxy's transparent listener
        conn.original_dst = (str(address[0]), int(address[1])) if address else None
        await td.identify(rt, conn, context.client)
    if conn.original_dst is None:
        return RefuseLayer(context, b"")
    data = nextlayer.data_client()
    if not data and isinstance(nextlayer, _TransparentNext) and nextlayer.client_silent:
        nextlayer.client_silent = False  # asked once; the client's first bytes are judged as usual
        return await _server_first(rt, conn, context)
    if len(data) < 3:
        return None
    if starts_like_tls_record(data):
        policy = rt.policies.get(conn.policy_name)
        if conn.refusal is None and policy is not None and policy.has_passthrough:
            # the SNI may name a passthrough route: read it first (Transparent.passthrough_name decides)
            return SniPeekLayer(context, rt, conn, lambda: _intercepting(context, rt))
        return _intercepting(context, rt)
    if looks_like_http(data):
        if data[:8].upper() == b"CONNECT ":
            return await _refuse_raw(rt, conn, context, gateway_deny(Reason.PROTOCOL_NOT_ALLOWED, NOT_A_PROXY),
                                     as_sent=data[:data.find(b"\n")].decode("latin-1").strip()[:200])
        return http_layer(context, HTTPMode.transparent, rt)
    if data.isalpha() and len(data) < _METHOD_MAX:
        return None  # an HTTP method still arriving
    return await _raw_tcp(rt, conn, context)


def _intercepting(context, rt: Runtime) -> layer.Layer:
    """TLS intercepted whatever happens: the SNI decision (Transparent.tls_clienthello) either binds the
    connection to the pinned name or leaves the refusal that every request inside will get."""
    server_tls = layers.ServerTLSLayer(context)
    server_tls.child_layer = client_tls_layer(context, rt)
    return server_tls


async def _refuse_raw(rt: Runtime, conn: ConnState, context, decision, as_sent: str | None) -> layer.Layer:
    request_id = new_request_id()
    host, port = conn.original_dst or (None, None)
    decided = (conn.refusal or decision, None, None, None)
    decision = await td.record(rt, conn, context.client, request_id, decided, host=host, port=port,
                               as_sent=as_sent)
    return RefuseLayer(context, raw_deny(decision, request_id))


async def _server_first(rt: Runtime, conn: ConnState, context) -> layer.Layer | None:
    """A silent client: relay raw TCP when a `tcp` rule allows the original IP:port (the server may
    speak first); anything else keeps waiting for the client's bytes (a slow HTTP or TLS client is
    judged when they come; a silent one is cut at the header deadline), and nothing is recorded yet."""
    if conn.refusal is not None:
        return None
    host, decided = await td.raw_tcp_decision(rt, conn)
    if not decided[0].allowed:
        return None
    return await _raw_tcp(rt, conn, context, (host, decided))


async def _raw_tcp(rt: Runtime, conn: ConnState, context,
                   known: tuple[str, td.Decided] | None = None) -> layer.Layer:
    """Neither TLS nor HTTP: raw TCP, allowed only by a `tcp` rule for the original IP:port."""
    assert conn.original_dst is not None
    as_sent = _fmt(*conn.original_dst)
    if conn.refusal is not None:
        return await _refuse_raw(rt, conn, context, conn.refusal, as_sent)
    request_id = new_request_id()
    host, decided = known or await td.raw_tcp_decision(rt, conn)
    port = conn.original_dst[1]
    decision = await td.record(rt, conn, context.client, request_id, decided, host=host, port=port,
                               as_sent=as_sent, scheme="tcp")
    target = decided[1]
    if not decision.allowed or target is None:
        return RefuseLayer(context, raw_deny(decision, request_id))
    refusal = await refuse_unrecorded(rt, conn, host, port, decision.rule_id, request_id, "tcp")  # history.py
    if refusal is not None:
        return RefuseLayer(context, raw_deny(refusal, request_id))
    td.commit(conn, host, port, as_sent, target)
    conn.allow_tcp(decision.rule_id, request_id)
    return layers.TCPLayer(context)


def refused_inner_layer(rt: Runtime, conn: ConnState, context, data: bytes) -> layer.Layer | None:
    """Inside the intercepted TLS of a refused transparent connection: HTTP gets the deny per request
    (identity.py answers every request with `conn.refusal`), anything else the raw deny and the close."""
    assert conn.refusal is not None
    if context.client.alpn in HTTP_ALPNS:
        return http_layer(context, HTTPMode.transparent, rt)
    if len(data) < 3:
        return None
    if looks_like_http(data):
        return http_layer(context, HTTPMode.transparent, rt)
    return RefuseLayer(context, raw_deny(conn.refusal, conn.refusal_id or new_request_id()))
