"""The transparent listener (`listen.transparent`): sandboxes whose every TCP connection a runtime DNATs
to the gateway, whether or not they use HTTP_PROXY.

A proxy is advice; the runtime (egressgate/runtimes/) makes it a boundary by redirecting all TCP here.
Such a connection carries no CONNECT and no Proxy-Authorization, so:

* **Identity** is the source address registered at admission (transparent_decide.identify). An unknown
  source, a revoked sandbox or one over its connection limit is refused; Proxy-Authorization is never
  read here, and a CONNECT or an absolute-form request (a client treating this as a proxy) is refused.
* **The destination is a name**: the TLS SNI, or for plain HTTP the Host of the first request. It binds
  the connection like a CONNECT target; every request inside must name it again (consistency.py), so a
  connection never carries two destinations (Host switching, fronting). The gateway resolves and pins
  that name itself (pinning.py): **the original destination IP the client dialed is never dialed**,
  and an IP-literal SNI/Host is judged as that literal (metadata and private ranges refused). No name →
  deny. Bytes that are neither TLS nor HTTP pass only a `tcp` rule for the original IP:port.
* **Passthrough by SNI**: when the sandbox's policy has `tls: passthrough` rules, a TLS connection starts
  on passthrough_peek.SniPeekLayer; if its one clear SNI's first allowing rule is a passthrough rule it
  is decided, pinned, recorded and spliced unread (passthrough.py), otherwise intercepted as below.
* **A refusal is delivered** the way the explicit proxy delivers one inside a tunnel: TLS is intercepted
  with the gateway CA (no upstream connection) and every request gets the deny body; plain HTTP gets it
  directly; other bytes get the raw deny bytes and the close. The refusal is audited with the sandbox id.
* **Never eager**: mitmproxy's TransparentProxy layer opens the upstream connection to the original
  destination on accept. `install()` makes the transparent listener start with `TransparentRoot`, which
  opens nothing; the decision comes first. (Were it not installed, pinning.py would still refuse that
  undecided connection, and with it the client: fail closed.)

Everything else is the explicit proxy's, unchanged: the bounded TLS and HTTP layers (tls_limits.py,
http_limits.py), the guarded WebSocket layer, connguard deadlines, budgets, credentials, audit.
"""

from __future__ import annotations

import contextlib
import logging

from mitmproxy import http
from mitmproxy import tls as mitm_tls
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import commands, events, layer, layers, mode_servers
from mitmproxy.proxy.layers import tls
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tls import HTTP_ALPNS

from egressgate.gateway import transparent_decide as td
from egressgate.gateway.context import ConnState, FlowState, Runtime, ensure_flow_state, new_request_id
from egressgate.gateway.deny import gateway_deny, raw_deny
from egressgate.gateway.history import record_contact, refuse_unrecorded
from egressgate.gateway.http_limits import http_layer
from egressgate.gateway.identity import NOT_A_PROXY
from egressgate.gateway.passthrough_peek import SniName, SniPeekLayer
from egressgate.gateway.pinning import resolve_target
from egressgate.gateway.refuse import RefuseLayer, looks_like_http
from egressgate.gateway.tls_limits import client_tls_layer
from egressgate.policy.canon import CanonError, split_host_port
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)

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


def _is_proxy_form(request: http.Request) -> bool:
    """CONNECT, or an HTTP/1 absolute-form target (HTTP/2's :authority is not a proxy form)."""
    return request.method.upper() == "CONNECT" or (
        not request.is_http2 and not request.is_http3 and bool(request.authority))


class Transparent:
    """Addon (after Identity, before Consistency): the name decision of transparent connections."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def tls_clienthello(self, data: mitm_tls.ClientHelloData) -> None:
        context = data.context
        conn = self.rt.conns.get(context.client.id)
        if conn is None or not conn.transparent or conn.tunnel_host is not None or conn.original_dst is None:
            return
        if sum(isinstance(lay, tls.ClientTLSLayer) for lay in context.layers) != 1:
            return  # only the connection's own handshake names it (TLS inside it is the tunnel's business)
        sni = data.client_hello.sni
        port = conn.original_dst[1]
        host, refusal = td.canonical_name(sni)
        refusal = conn.refusal or refusal
        if refusal is not None or host is None:
            decided: td.Decided = (refusal or gateway_deny(Reason.INVALID_REQUEST, td.NO_NAME), None, None, None)
        else:
            decided = await td.name_decision(self.rt, conn, host, port)
        request_id = new_request_id()
        decision = await td.record(self.rt, conn, context.client, request_id, decided,
                                   host=host or conn.original_dst[0], port=port, as_sent=sni)
        target = decided[1]
        if decision.allowed and target is not None and host is not None:
            td.commit(conn, host, port, sni, target)
            return
        conn.refusal, conn.refusal_id = decision, request_id
        # intercept with the gateway CA and answer each request with the deny; no upstream connection
        data.establish_server_tls_first = False

    async def passthrough_name(self, data: SniName) -> None:
        """A ClientHello naming `data.sni` on a policy with passthrough rules: when the name's first
        allowing rule is a passthrough rule, decide, resolve, pin, record and commit it here and splice
        (passthrough.py). Anything else is left to the interception path (tls_clienthello), which
        decides and records it: nothing is recorded here for a name that is not spliced."""
        conn = self.rt.conns.get(data.context.client.id)
        if (conn is None or not conn.transparent or conn.tunnel_host is not None or conn.original_dst is None
                or conn.refusal is not None):
            return
        host, refusal = td.canonical_name(data.sni)
        if refusal is not None or host is None:
            return
        port = conn.original_dst[1]
        decision, facts, snapshot = await td.connect_decision(self.rt, conn, host, port)
        if not decision.passthrough:
            return
        target, denied = await resolve_target(self.rt, self.rt.policies.get(conn.policy_name), host, port)
        if denied is not None or target is None:
            return  # tls_clienthello decides again and records the refusal (one record per connection)
        if await record_contact(self.rt, conn.sandbox_id, host, decision.rule_id) is not None:
            return  # no history, no splice: intercepted instead, each request then enters the history itself
        request_id = new_request_id()
        decision = await td.record(self.rt, conn, data.context.client, request_id,
                                   (decision, target, facts, snapshot), host=host, port=port, as_sent=data.sni)
        if not decision.allowed:  # the record was not durable: intercepted, every request denied
            conn.refusal, conn.refusal_id = decision, request_id
            return
        td.commit(conn, host, port, data.sni, target)
        conn.passthrough = True
        conn.intercept = False
        conn.allow_tcp(decision.rule_id, request_id)
        data.splice = True

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        conn = self.rt.conns.get(flow.client_conn.id)
        if conn is None or not conn.transparent or flow.response is not None:
            return
        fs = ensure_flow_state(flow)
        request = flow.request
        if fs.decision is None and _is_proxy_form(request):
            fs.decision = gateway_deny(Reason.PROTOCOL_NOT_ALLOWED, NOT_A_PROXY)
        if fs.decision is None and conn.tunnel_host is None:
            await self._bind_plain(flow, fs, conn)
        if fs.decision is not None and fs.host is None and conn.tunnel_host is None:
            self._name_for_record(fs, request, conn)

    async def _bind_plain(self, flow: http.HTTPFlow, fs: FlowState, conn: ConnState) -> None:
        """The first plain-HTTP request names the connection's destination by its Host."""
        assert conn.original_dst is not None
        if flow.client_conn.tls:  # a TLS connection is named at its ClientHello or refused there
            fs.decision = gateway_deny(Reason.INVALID_REQUEST, td.NO_NAME)
            return
        hosts = flow.request.headers.get_all("host")
        if len(hosts) > 1:
            fs.decision = gateway_deny(Reason.INVALID_REQUEST, "Send exactly one Host header.")
            return
        port = conn.original_dst[1]
        raw = hosts[0] if hosts else None
        host, denied = td.host_header_name(raw, port)
        if denied is not None or host is None:
            fs.decision = denied
            conn.refusal = denied
            return
        fs.host, fs.port = host, port
        decision, target, facts, snapshot = await td.name_decision(self.rt, conn, host, port)
        policy = self.rt.policies.get(conn.policy_name)
        fs.policy_hash = policy.hash if policy is not None else None
        if not decision.allowed or target is None:
            fs.decision = decision
            fs.facts, fs.state = facts, snapshot
            conn.refusal = decision  # the response closes the connection; nothing after it may pass
            return
        td.commit(conn, host, port, raw, target)
        # dial the pinned address under its own key, so every later request on this connection reuses
        # the upstream connection (mitmproxy takes a transparent request's address from the server)
        pinned = (str(target.address), port)
        flow.request.data.host = pinned[0]
        flow.server_conn.address = pinned
        conn.approved.pop(conn.original_dst, None)
        fs.dial_key = pinned  # approved by pinning.py once the decision record is durable

    @staticmethod
    def _name_for_record(fs: FlowState, request: http.Request, conn: ConnState) -> None:
        """A refused request's record names the Host it sent (best effort), not the dialed IP."""
        hosts = request.headers.get_all("host")
        if len(hosts) == 1 and conn.original_dst is not None:
            with contextlib.suppress(CanonError):
                fs.host, fs.port = split_host_port(hosts[0], conn.original_dst[1])
