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
  destination on accept. `install()` (transparent_layers.py, with the layer choice for the connection's
  first bytes, NextLayer's) makes the transparent listener start with `TransparentRoot`, which
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
from mitmproxy.proxy.layers import tls

from egressgate.gateway.shared import transparent_decide as td
from egressgate.gateway.shared.context import ConnState, FlowState, Runtime, ensure_flow_state, new_request_id
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.destination import resolve_target
from egressgate.gateway.shared.history import record_contact
from egressgate.gateway.shared.sources import NOT_A_PROXY
from egressgate.gateway.tunnels.passthrough_peek import SniName
from egressgate.policy.canon import CanonError, split_host_port
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)

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
