"""Credential injection and scrubbing in the live gateway (the mitmproxy side of egressgate/broker/).

Where it sits (master.py, docs/architecture.md): after Identity, Consistency, Sanitize, Decision and
Trailers, before Budgets and Record. So in `requestheaders` every earlier check has already had its say —
a flow that is answered (`flow.response`) or not allowed is never touched — a deny set here
(`credential_unavailable`, `credential_misuse`, TRACE) comes before Budgets reserves any byte, and it is
the one decision record Record writes; Record also refuses the request if that record cannot be
written, so an injected header never leaves without its audit record. For an intercepted tunnel,
address pinning ran even earlier: with the eager connection
strategy the upstream connection of a CONNECT tunnel is opened (server_connect → Pinning rewrites the
address, server_connected checks the peer) and its TLS is established before the client's first
request; a later reconnect goes through Pinning again. `_channel_problem` re-checks all of it before a
credential is placed, and refuses rather than trusts.

Request side: only HTTPS inside an intercepted tunnel, only when the decision's matched rule names the
capability (`Decision.capability`); TRACE refused; phantoms anywhere except their one bound header are
`credential_misuse` — headers, query and path here, buffered bodies in `request`, streamed bodies by a
guard compose.py chains before the budget counter. Response side: headers (Location, Set-Cookie, ...) and bodies
are scrubbed of the injected value; compressed bodies are decoded first or the response is refused
(credential_response.py, its own addon after Budgets; the stream callables live in credential_streams.py).
Audit records carry the capability name and key id, never a value; so do logs and error pages.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import OrderedDict
from dataclasses import replace
from urllib.parse import unquote

from mitmproxy import http

from egressgate.audit.build import build
from egressgate.audit.event import AuditUnavailable, EventKind
from egressgate.broker.broker import Broker
from egressgate.broker.config import BasicPlacement, QueryPlacement
from egressgate.broker.credential import Credential, CredentialUnavailable
from egressgate.broker.inject import PhantomHit, find_phantoms, inject, redact_phantoms, scan_bytes, swap_phantom
from egressgate.broker.redact import cached_scrubber
from egressgate.config import GatewayConfig
from egressgate.gateway.layers import ws_layer
from egressgate.gateway.shared import emit
from egressgate.gateway.shared.context import FlowState, Runtime, flow_state
from egressgate.gateway.shared.counters import refund_prepaid
from egressgate.gateway.shared.credential_streams import fields
from egressgate.gateway.shared.deny import deny_response, gateway_deny
from egressgate.gateway.shared.flowtypes import Applied
from egressgate.gateway.shared.misuse import MISUSE_MESSAGE, misuse_event, stream_misuse
from egressgate.policy.errors import PolicyError
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)

SEEN_MAX = 10000

_UNAVAILABLE_MESSAGE = "The credential for this destination could not be obtained; nothing was sent. Retry later."


def _same_ip(a: str, b: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    try:
        ip = ipaddress.ip_address(a.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(b, ipaddress.IPv6Address) and b.ipv4_mapped is not None:
        b = b.ipv4_mapped
    return ip == b


def _may_hold_phantom(headers: list[tuple[str, str]], raw_path: str) -> bool:
    """Cheap pre-check before the full phantom search (hot path: every request). A phantom is
    `egph_` + hex, case-insensitive, any character possibly escaped (broker/escapes.py: every escape
    starts with `%`, `\\` or `&`): without "egph" (any case) and without one of those anywhere in the
    header names/values and the raw path+query, find_phantoms cannot hit."""
    blob = raw_path + "\n".join(f"{k}\n{v}" for k, v in headers)
    return "%" in blob or "\\" in blob or "&" in blob or "egph" in blob.lower()


def _redact_target(text: str) -> str:
    """A request target for the misuse record, without the phantom in any form: escaped forms are cut
    in place; one escaped *and* percent-encoded (`%26%23101%3B...` in a raw query) is found once the
    target is percent-decoded, and then the decoded target is recorded, redacted."""
    out = redact_phantoms(text)
    decoded = unquote(out)
    if decoded != out and scan_bytes(decoded.encode("utf-8", "surrogateescape")):
        out = redact_phantoms(decoded)
    return out


def check_broker(broker: Broker | None, policies: dict) -> None:
    """Load-time check: a capability the broker's backend cannot serve (a vault source under the local
    backend, ...) refuses the policy set, like any other policy error, instead of failing per request."""
    if broker is None:
        return
    for _pname, policy in sorted(policies.items()):
        problems = [(f"credentials.capabilities.{name}", problem)
                    for name, cap in sorted(policy.capabilities.items())
                    if (problem := broker.check(name, cap))]
        if problems:
            raise PolicyError(str(policy.source), problems)


async def start_broker(config: GatewayConfig, policies: dict) -> Broker:
    """Build the configured broker. A backend that cannot start (Vault unreachable, bad AppRole) does
    not stop the gateway: requests that need a credential fail closed with credential_unavailable,
    everything else keeps working, and the Vault backend logs in again on its next call."""
    broker = Broker.from_config(config.broker_config())
    check_broker(broker, policies)
    try:
        await broker.start()
    except CredentialUnavailable as exc:
        logger.error("credential broker (%s) did not start: %s; credentialed routes will be denied",
                     config.broker.backend, exc)
    return broker


class Credentials:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        # (capability, sandbox, audience) -> last credential used: a different object means a new mint
        self._seen: OrderedDict[tuple[str, str, str], Credential] = OrderedDict()
        runtime.state.on_revoke(self._revoked)

    def _revoked(self, sandbox_id: str) -> None:
        if self.rt.broker is not None:
            self.rt.broker.forget(sandbox_id)
        for key in [k for k in self._seen if k[1] == sandbox_id]:
            del self._seen[key]

    # ------------------------------------------------------------------ request side
    def _deny(self, fs: FlowState, reason: Reason, message: str, detail: str | None = None) -> None:
        """Turn the allow into a deny before record.py records it. At the headers nothing is prepaid yet
        (Budgets runs after this addon); a buffered body's misuse (`request`) returns the prepayment."""
        rule = fs.decision.rule_id if fs.decision is not None else None
        capability = fs.decision.capability if fs.decision is not None else None
        refund_prepaid(self.rt, fs)
        # the record keeps the capability the rule named (never a value)
        fs.decision = replace(gateway_deny(reason, message, detail=detail, rule_id=rule), capability=capability)

    def _channel_problem(self, flow: http.HTTPFlow, fs: FlowState) -> str | None:
        """Why a credential must not be placed on this flow (None: HTTPS to the pinned destination)."""
        conn = self.rt.conns.get(flow.client_conn.id)
        if fs.scheme != "https" or flow.request.scheme != "https":
            return "not_https"
        if conn is None or conn.closed or conn.tunnel_target is None or not conn.intercept:
            return "no_intercepted_tunnel"
        if not flow.client_conn.tls_established or conn.sni_mismatch is not None:
            return "client_tls"
        target = conn.tunnel_target
        if fs.pinned is not target or (fs.host, fs.port) != (target.host, target.port):
            return "target_mismatch"
        server = flow.server_conn
        if not server.tls:
            return "upstream_not_tls"
        if server.address is not None and server.address != (str(target.address), target.port):
            return "address_not_pinned"
        if server.peername is not None and not _same_ip(str(server.peername[0]), target.address):
            return "peer_not_pinned"
        if target.sni is not None and server.sni is not None and server.sni != target.sni:
            return "sni_not_pinned"
        return None

    async def _phantom_hash(self, fs: FlowState, name: str) -> str | None:
        assert fs.sandbox_id is not None
        record = await self.rt.state.get(fs.sandbox_id)
        return record.phantoms.get(name) if record is not None else None

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is None or fs.decision is None or not fs.decision.allowed or flow.response is not None:
            return
        req = flow.request
        name = fs.decision.capability
        policy = self.rt.policies.get(fs.policy_name)
        cap = policy.capabilities.get(name) if policy is not None and name else None
        phantom_hash = None
        if cap is not None and cap.mode == "phantom":
            try:
                phantom_hash = await self._phantom_hash(fs, name)
            except StateUnavailable:
                self._deny(fs, Reason.STATE_UNAVAILABLE, "The gateway's state store is unavailable; retry later.")
                return
        headers = list(req.headers.items(multi=True))
        query: list[tuple[str, str]] = []
        if _may_hold_phantom(headers, req.path):
            query = list(req.query.items(multi=True))
            allowed = (cap.placement.header, phantom_hash) if cap is not None and phantom_hash else None
            hits = find_phantoms(headers, query, path=req.path, allowed=allowed)
            if hits:
                self._misuse(fs, hits)
                return
        elif cap is not None and isinstance(cap.placement, QueryPlacement):
            query = list(req.query.items(multi=True))  # parsed only when the credential goes there
        if name is not None:
            await self._inject(flow, fs, policy, name, cap, phantom_hash, headers, query)
        # a streamed body is guarded chunk by chunk (compose.py: phantom guard, calls stream_misuse)

    async def _inject(self, flow, fs: FlowState, policy, name: str, cap, phantom_hash, headers, query) -> bool:
        req = flow.request
        if cap is None:  # the rule names a capability the (reloaded) policy no longer defines
            self._deny(fs, Reason.CREDENTIAL_UNAVAILABLE, _UNAVAILABLE_MESSAGE, detail="unknown_capability")
            return False
        if req.method.upper() == "TRACE":
            self._deny(fs, Reason.METHOD_NOT_ALLOWED,
                       "TRACE is refused on routes that carry a credential (it would echo the credential).",
                       detail="trace_on_credentialed_route")
            return False
        problem = self._channel_problem(flow, fs)
        if problem is not None:
            logger.error("capability %s not injected for %s: %s", name, fs.sandbox_id, problem)
            self._deny(fs, Reason.CREDENTIAL_UNAVAILABLE,
                       "Credentials are only injected over HTTPS to the checked destination.", detail=problem)
            return False
        broker = self.rt.broker
        assert fs.sandbox_id is not None and fs.host is not None
        try:
            if broker is None:
                raise CredentialUnavailable("no credential broker configured")
            cred = await broker.issue(name, cap, fs.sandbox_id, fs.host, self.rt.clock(),
                                      max_ttl_seconds=policy.model.credentials.max_ttl_seconds)
        except CredentialUnavailable as exc:
            logger.warning("capability %s unavailable for %s: %s", name, fs.sandbox_id, exc)
            self._deny(fs, Reason.CREDENTIAL_UNAVAILABLE, _UNAVAILABLE_MESSAGE)
            return False
        if flow.response is not None or fs.decision is None or not fs.decision.allowed:
            return False  # answered while we awaited the broker
        problem = self._channel_problem(flow, fs)  # again: a revocation or reconnect may have raced the await
        if problem is not None:
            self._deny(fs, Reason.CREDENTIAL_UNAVAILABLE,
                       "Credentials are only injected over HTTPS to the checked destination.", detail=problem)
            return False
        if not await self._audit_mint(fs, name, cred):
            self._deny(fs, Reason.AUDIT_UNAVAILABLE, "The audit trail is unavailable; nothing is allowed. Retry later.")
            return False
        if cap.mode == "phantom":
            if phantom_hash is None:
                inj = swap_phantom(cap, cred, "", headers, query)  # strips; a hash never equals ""
            else:
                inj = swap_phantom(cap, cred, phantom_hash, headers, query)
        else:
            inj = inject(cap, cred, headers, query)
        req.headers = fields(inj.headers)
        if inj.set_query is not None:
            req.query = inj.query
        if not inj.swapped:
            return True  # phantom mode without the phantom: nothing injected (its own Authorization is gone)
        req.headers["accept-encoding"] = "identity"
        username = cap.placement.basic.username if isinstance(cap.placement, BasicPlacement) else None
        fs.credential = Applied(name, cred, username)
        return True

    async def _audit_mint(self, fs: FlowState, name: str, cred: Credential) -> bool:
        """One CREDENTIAL_ISSUE record per minted credential (not per use: every use is in the request's
        decision record with capability and key id)."""
        assert fs.sandbox_id is not None and fs.host is not None
        key = (name, fs.sandbox_id, fs.host)
        if self._seen.get(key) is cred:
            return True
        event = build(
            EventKind.CREDENTIAL_ISSUE, sandbox_id=fs.sandbox_id, decision="allow", reason=str(Reason.RULE_MATCHED),
            rule_id=fs.decision.rule_id if fs.decision else None, policy_name=fs.policy_name,
            policy_hash=fs.policy_hash, host=fs.host, port=fs.port, capability=name, key_id=cred.key_id,
            extra={"egressgate.trigger_request": fs.request_id,
                   "egressgate.credential.expires_at": int(cred.expires_at)},
        )
        try:
            await emit.write(self.rt, event)
        except AuditUnavailable as exc:
            logger.error("credential issue could not be audited: %s", exc)
            return False
        self._seen[key] = cred
        self._seen.move_to_end(key)
        while len(self._seen) > SEEN_MAX:
            self._seen.popitem(last=False)
        return True

    def _misuse(self, fs: FlowState, hits: list[PhantomHit]) -> None:
        where = ",".join(sorted({h.where + (f":{h.name.lower()}" if h.name else "") for h in hits}))
        where = redact_phantoms(where)  # a header *name* may be the phantom
        logger.warning("phantom credential misuse by %s to %s (%s)", fs.sandbox_id, fs.host, where)
        # the audit record must not carry the placeholder either (query / raw target as sent)
        fs.query = _redact_target(fs.query) if fs.query else fs.query
        fs.path = _redact_target(fs.path) if fs.path else fs.path
        if fs.target_as_sent:
            fs.target_as_sent = _redact_target(fs.target_as_sent)
        self._deny(fs, Reason.CREDENTIAL_MISUSE, MISUSE_MESSAGE, detail=where[:200])

    async def request(self, flow: http.HTTPFlow) -> None:
        """Buffered request bodies (streamed ones are guarded chunk by chunk)."""
        fs = flow_state(flow)
        if fs is None or fs.decision is None or not fs.decision.allowed or flow.response is not None:
            return
        if flow.request.stream or not flow.request.raw_content:
            return
        hits = find_phantoms([], [], flow.request.raw_content)
        if not hits:
            return
        self._misuse(fs, hits)
        fs.credential = None
        await emit.write_after(self.rt, misuse_event(fs, "body"))
        assert fs.decision is not None
        flow.response = deny_response(fs.decision, fs.request_id)

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """Websockets on a credentialed route: server messages are scrubbed (whole messages, so no
        window is needed); a phantom in a client message is misuse on any route (closed + audited)."""
        fs = flow_state(flow)
        if flow.websocket is None or fs is None:
            return
        message = flow.websocket.messages[-1]
        if message.dropped:
            return
        if message.from_client:
            hits = find_phantoms([], [], message.content)
            if hits:
                message.drop()
                self._ws_misuse(flow, fs, hits, "websocket")
            return
        applied = fs.credential
        if applied is not None:
            message.content = cached_scrubber(applied.spec()).scrub(message.content)

    def websocket_control(self, frame: ws_layer.ControlFrame) -> None:
        """Ping, Pong and Close carry bytes too (up to 125; a Close its reason): the same rules as for
        messages — a phantom from the client is misuse (closed + audited), and on a credentialed route
        the server's payload is scrubbed before the sandbox sees it (an echo of the injected header)."""
        flow = frame.flow
        fs = flow_state(flow)
        if fs is None:
            ws_layer.refuse(flow, Reason.INTERNAL_ERROR, ws_layer.INTERNAL_ERROR,
                            "The gateway lost track of this websocket; it was closed.")
            return
        if frame.from_client:
            hits = find_phantoms([], [], frame.payload)
            if hits:
                self._ws_misuse(flow, fs, hits, f"websocket_{frame.kind}")
            return
        applied = fs.credential
        if applied is not None and frame.payload:
            frame.payload = cached_scrubber(applied.spec()).scrub(frame.payload)

    def _ws_misuse(self, flow: http.HTTPFlow, fs: FlowState, hits: list[PhantomHit], where: str) -> None:
        """A phantom on a websocket: the frame is not relayed, the websocket is closed (1008) by the
        layer and the deny is audited like a phantom in a streamed body."""
        ws_layer.refuse(flow, Reason.CREDENTIAL_MISUSE, ws_layer.POLICY_VIOLATION, MISUSE_MESSAGE, detail=where)
        stream_misuse(self.rt, flow, fs, hits, where, cut=False)

    # ------------------------------------------------------------------ response side
