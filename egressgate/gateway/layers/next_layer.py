"""What runs inside a CONNECT tunnel: TLS interception, HTTP, or (only when a rule allows) raw TCP.

This replaces mitmproxy's NextLayer addon instead of wrapping it: its defaults include raw TCP relays
for non-HTTP bytes, a DNS relay for port 53 and passthrough for ignore_hosts — each a way around the
per-request decision. Here every layer is chosen explicitly:

* root (explicit proxy): mitmproxy's explicit-HTTP-proxy stack;
* root (transparent listener): transparent.py picks TLS interception, HTTP, or a raw-TCP decision by the
  original destination; after that, a transparent connection bound to its name is handled like a tunnel;
* every HTTP layer is the gateway's (http_layer.py: HTTP/1 trailers and 1xx handled, a refusal in the
  `request` hook of a streamed request enforced);
* inside a tunnel whose CONNECT was allowed by a `tls: passthrough` rule: passthrough.py (the ClientHello
  must name the CONNECT host, then a counting splice, no interception);
* inside a tunnel whose CONNECT was allowed only by a raw-TCP rule (`intercept=False`): a TCP relay;
* otherwise TLS → intercept (MITM with the gateway CA) → HTTP; plaintext HTTP → HTTP;
* inside a refused CONNECT accepted to deliver its deny (refused_tunnel.py): TLS intercepted, HTTP
  answered with the deny, other bytes the raw deny; never a server connection;
* any other bytes → a raw-TCP decision (`network.tcp.allow` for host:port) → relay, or the deny
  contract and a closed connection. Nothing is forwarded before that decision.
* a websocket (after an allowed HTTP upgrade): ws_layer.GuardedWebsocketLayer, installed when this addon
  loads (mitmproxy's HTTP layer creates websocket layers itself, not through next_layer); a websocket
  that starts without it is aborted.
"""

from __future__ import annotations

import logging

from mitmproxy import tls as mitm_tls
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import layer, layers, mode_specs
from mitmproxy.proxy.layers import modes, tls
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tls import HTTP_ALPNS

from egressgate.audit.build import build
from egressgate.audit.event import AuditUnavailable, EventKind
from egressgate.gateway.layers import refused_layers, transparent_layers, ws_layer
from egressgate.gateway.layers.http_limits import explicit_http_proxy, http_layer
from egressgate.gateway.layers.refuse import RefuseLayer, looks_like_http
from egressgate.gateway.layers.tls_limits import BoundedClientTLSLayer, client_tls_layer
from egressgate.gateway.shared import emit
from egressgate.gateway.shared.context import ConnState, Runtime, new_request_id
from egressgate.gateway.shared.deny import gateway_deny, raw_deny
from egressgate.gateway.shared.flow_decision import decide_flow
from egressgate.gateway.shared.history import record_contact, refuse_unrecorded
from egressgate.gateway.tunnels.passthrough import PassthroughLayer
from egressgate.policy.facts import Decision, Facts, Operation
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)


class NextLayer:
    """Addon named `nextlayer` so mitmproxy's own NextLayer is never needed (and never added)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def load(self, loader) -> None:
        ws_layer.install(self.rt.config.websocket.max_message_bytes)
        transparent_layers.install()

    def websocket_start(self, flow) -> None:
        """Fail closed: a websocket whose frames would not pass GuardedWebsocketLayer (install() did not
        take, e.g. after a mitmproxy upgrade) is cut before it relays a frame."""
        if not ws_layer.guarded(flow):
            logger.error("websocket of client %s is not guarded; aborting it", flow.client_conn.id)
            if self.rt.abort_connection is not None:
                self.rt.abort_connection(flow.client_conn.id)

    def tls_clienthello(self, data: mitm_tls.ClientHelloData) -> None:
        """Fail closed: a client handshake that did not run on tls_limits.BoundedClientTLSLayer (a layer
        built somewhere other than `client_tls_layer()`, e.g. after a mitmproxy upgrade) had its
        ClientHello buffered without the gateway's bound: the connection is cut, not intercepted."""
        client_layers = [lay for lay in data.context.layers if isinstance(lay, tls.ClientTLSLayer)]
        if client_layers and isinstance(client_layers[-1], BoundedClientTLSLayer):
            return
        logger.error("TLS handshake of client %s is not on the bounded layer; aborting it", data.context.client.id)
        if self.rt.abort_connection is not None:
            self.rt.abort_connection(data.context.client.id)

    async def next_layer(self, nextlayer: layer.NextLayer) -> None:
        if nextlayer.layer is not None:
            return
        context = nextlayer.context
        data = nextlayer.data_client()
        if context.client.transport_protocol != "tcp":
            nextlayer.layer = RefuseLayer(context, b"")
            return
        top = context.layers[-1] if context.layers else None
        if len(context.layers) == 1 and isinstance(top, modes.HttpProxy):
            if isinstance(context.client.proxy_mode, mode_specs.RegularMode):
                nextlayer.layer = explicit_http_proxy(context, data, self.rt)
            return
        if len(context.layers) == 1 and isinstance(top, transparent_layers.TransparentRoot):
            nextlayer.layer = await transparent_layers.root_layer(self.rt, nextlayer)
            return
        conn = self.rt.conns.get(context.client.id)
        if conn is not None and conn.transparent and conn.refusal is not None:
            if isinstance(top, layers.ClientTLSLayer):
                nextlayer.layer = transparent_layers.refused_inner_layer(self.rt, conn, context, data)
            else:
                nextlayer.layer = RefuseLayer(context, b"")
            return
        if conn is not None and conn.refused_target is not None:
            # a refused CONNECT accepted to deliver its deny (refused_tunnel.py): intercept, answer, never forward
            nextlayer.layer = refused_layers.inner_layer(self.rt, conn, context, data)
            return
        if conn is None or conn.tunnel_host is None:
            nextlayer.layer = RefuseLayer(context, b"")
            return
        if not conn.intercept and conn.tcp_allowed_rule is not None and not context.client.tls:
            # a relayed tunnel is a request to its host: into the history before its first byte goes up
            if conn.passthrough:  # its refusal is audited as the tunnel's outcome record (passthrough.py)
                refusal = await record_contact(self.rt, conn.sandbox_id, conn.tunnel_host, conn.tcp_allowed_rule)
                nextlayer.layer = PassthroughLayer(context, self.rt, conn, refusal)  # checks the SNI, splices
                return
            request_id = conn.tcp_request_id or new_request_id()
            refusal = await refuse_unrecorded(self.rt, conn, conn.tunnel_host, conn.tunnel_port,
                                              conn.tcp_allowed_rule, request_id, "tcp")
            # asked as the tunnel opens (http_layer.py): a refusal is still answered at the client's first bytes
            nextlayer.layer = layers.TCPLayer(context) if refusal is None else RefuseLayer(
                context, raw_deny(refusal, request_id), at_first_bytes=True)
            return
        after_tls = isinstance(top, layers.ClientTLSLayer)
        if not after_tls and len(data) < 3:
            return  # wait for more bytes (mitmproxy asks again on the next DataReceived)
        if not after_tls and starts_like_tls_record(data):
            server_tls = layers.ServerTLSLayer(context)
            server_tls.child_layer = client_tls_layer(context, self.rt)
            nextlayer.layer = server_tls
            return
        if after_tls and context.client.alpn in HTTP_ALPNS:
            nextlayer.layer = http_layer(context, HTTPMode.transparent, self.rt)
            return
        if after_tls and len(data) < 3:
            return
        if looks_like_http(data):
            nextlayer.layer = http_layer(context, HTTPMode.transparent, self.rt)
            return
        # One id for this decision: its audit record, the deny body the client reads, and the relay's
        # outcome record (via ConnState.tcp_request_id) all carry it.
        request_id = new_request_id()
        decision = await self._tcp_decision(conn, context.client.peername, request_id)
        if decision.allowed:
            decision = await refuse_unrecorded(self.rt, conn, conn.tunnel_host, conn.tunnel_port, decision.rule_id,
                                               request_id, "tcp") or decision
        if decision.allowed:
            conn.allow_tcp(decision.rule_id, request_id)
            nextlayer.layer = layers.TCPLayer(context)
        else:
            nextlayer.layer = RefuseLayer(context, raw_deny(decision, request_id))

    async def _tcp_decision(self, conn: ConnState, peer, request_id: str) -> Decision:
        policy = self.rt.policies.get(conn.policy_name)
        decision: Decision
        facts = state = None  # the record carries both, as an HTTP decision's does (audit replay reads them)
        if policy is None or conn.sandbox_id is None:
            decision = gateway_deny(Reason.POLICY_UNAVAILABLE)
        else:
            assert conn.tunnel_host is not None and conn.policy_name is not None
            asked = Facts(
                operation=Operation.HTTP_REQUEST, host=conn.tunnel_host, port=conn.tunnel_port, scheme="tcp",
                addresses=(conn.tunnel_target.address,) if conn.tunnel_target else (),
            )
            # a store that cannot answer: refused state_unavailable (fail closed), no facts recorded
            decision, state = await decide_flow(self.rt, policy, conn.policy_name, conn.sandbox_id, asked,
                                                approvals=False)
            if state is not None:
                facts = asked
                if not decision.allowed:
                    decision = gateway_deny(
                        Reason.PROTOCOL_NOT_ALLOWED,
                        f"Only HTTP(S) is allowed to {conn.tunnel_host}:{conn.tunnel_port}; no network.tcp rule "
                        f"allows raw TCP there.",
                        rule_id=decision.rule_id,
                    )
        event = build(
            EventKind.CONNECT, request_id=request_id, verdict=decision, sandbox_labels=conn.labels,
            sandbox_id=conn.sandbox_id, policy_name=conn.policy_name,
            policy_hash=policy.hash if policy is not None else None, target_as_sent=conn.tunnel_as_sent,
            scheme="tcp", host=conn.tunnel_host, port=conn.tunnel_port,
            pinned_address=str(conn.tunnel_target.address) if conn.tunnel_target else None,
            client_address=peer[0] if peer else None, capability=None, facts=facts, state=state,
        )
        try:
            await emit.write(self.rt, event)
        except AuditUnavailable:
            return gateway_deny(Reason.AUDIT_UNAVAILABLE)
        return decision

    def tcp_start(self, flow) -> None:
        """Defense in depth: any TCP relay the decision did not allow (e.g. a 101 to a non-websocket
        protocol) is killed before it relays a byte."""
        conn = self.rt.conns.get(flow.client_conn.id)
        if conn is None or conn.tcp_allowed_rule is None:
            logger.warning("killing an undecided raw TCP relay for client %s", flow.client_conn.id)
            flow.server_conn.error = "egressgate: raw TCP not allowed"
            flow.kill()
            if self.rt.abort_connection is not None:
                self.rt.abort_connection(flow.client_conn.id)
