"""Record every decision, then enforce it (the last addon of each decision hook).

Intent before effect: an allow takes effect (the tunnel's target is committed, the destination becomes
dialable) only after its audit record is durable; if the sink raises AuditUnavailable the request is
denied with `audit_unavailable`. A deny is answered with the deny contract whether or not the record
could be written. Outcome records (status, bytes, duration) follow the response, linked by request id.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mitmproxy import http, tcp

from egressgate.audit.event import AuditEvent, AuditUnavailable, EventKind
from egressgate.gateway import request_hash, ws_layer
from egressgate.gateway.budgets import TCP_CUT, TCP_IN, TCP_OUT, WS_IN, WS_OUT
from egressgate.gateway.context import ConnState, FlowState, Runtime, ensure_flow_state, flow_state, new_request_id
from egressgate.gateway.deny import REQUEST_ID_HEADER, deny_response, gateway_deny
from egressgate.gateway.target import note_target
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)


DENY_BUFFER_MAX = 64 * 1024
# FlowState.extra key: the `egressgate.mode` / `egressgate.original_dst` attributes of a flow on the
# transparent listener (transparent.py), repeated on its decision and outcome records
TRANSPARENT = "transparent"
WS_AUDITED = "egressgate.ws_audited"  # flow.metadata: the websocket session's outcome was written


def pending_body_too_large(request: http.Request) -> bool:
    """A body that is still to come and is chunked or declared larger than we are willing to buffer."""
    if "transfer-encoding" in request.headers:
        return True
    try:
        return int(request.headers.get("content-length", "0")) > DENY_BUFFER_MAX
    except ValueError:
        return True


def decision_event(kind: EventKind, fs: FlowState, labels: dict[str, str], client: str | None) -> AuditEvent:
    d = fs.decision
    assert d is not None
    extra: dict = {}
    if d.detail:
        extra["egressgate.detail"] = d.detail
    if "intercept" in fs.extra:
        extra["egressgate.intercept"] = bool(fs.extra["intercept"])
    if d.passthrough:
        extra["egressgate.tls"] = "passthrough"
    if fs.extra.get(TRANSPARENT):
        extra.update(fs.extra[TRANSPARENT])
    return AuditEvent(
        kind=kind,
        time_ns=fs.started_ns,
        request_id=fs.request_id,
        sandbox_id=fs.sandbox_id,
        sandbox_labels=dict(labels),
        decision=str(d.effect),
        reason=str(d.reason),
        rule_id=d.rule_id,
        policy_name=fs.policy_name,
        policy_hash=fs.policy_hash,
        target_as_sent=fs.target_as_sent,
        scheme=fs.scheme,
        host=fs.host,
        port=fs.port,
        method=fs.method,
        path=fs.path,
        query=fs.query,
        pinned_address=str(fs.pinned.address) if fs.pinned is not None and d.allowed else None,
        client_address=client,
        capability=d.capability,
        key_id=fs.extra.get("key_id"),  # set by credentials.py when a credential was placed
        message=None if d.allowed else d.message,
        bytes_out=fs.bytes_out if fs.prepaid_out else None,
        extra=extra,
        facts=fs.extra.get("facts"),
        state=fs.extra.get("state"),
        request_hash=fs.extra.get("bodyless_request_hash"),
    )


def transparent_attributes(conn: ConnState | None) -> dict[str, str]:
    """`egressgate.mode` = `transparent` (and the address the sandbox dialed) for a connection on the
    transparent listener; nothing for the explicit proxy (its records are unchanged)."""
    if conn is None or not conn.transparent:
        return {}
    out = {"egressgate.mode": "transparent"}
    if conn.original_dst is not None:
        host, port = conn.original_dst
        out["egressgate.original_dst"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return out


def mark_transparent(conn: ConnState | None, fs: FlowState) -> None:
    attributes = transparent_attributes(conn)
    if attributes:
        fs.extra[TRANSPARENT] = attributes


def _orphan_id(flow: tcp.TCPFlow) -> str:
    """A raw-TCP relay with no recorded decision id cannot happen (ConnState.allow_tcp sets both); if it
    ever does, the outcome is still written, under a fresh id, and the log says so."""
    logger.error("raw TCP outcome for client %s has no decision request id", flow.client_conn.id)
    return new_request_id()


class AuditEmit:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def _write(self, event: AuditEvent) -> bool:
        try:
            await self.rt.audit.write(event)
            return True
        except AuditUnavailable as exc:
            logger.error("audit sink unavailable: %s", exc)
            return False

    async def _record(self, kind: EventKind, flow: http.HTTPFlow, fs: FlowState) -> Decision:
        """Write the decision; return the decision to enforce (audit failure turns allow into deny)."""
        if fs.decision is None:  # no addon decided: fail closed
            fs.decision = gateway_deny(Reason.INVALID_REQUEST, "The gateway could not decide this request.")
        conn = self.rt.conns.get(flow.client_conn.id)
        labels = conn.labels if conn is not None else {}
        client = flow.client_conn.peername[0] if flow.client_conn.peername else None
        mark_transparent(conn, fs)
        ok = await self._write(decision_event(kind, fs, labels, client))
        fs.audited = True
        if not ok and fs.decision.allowed:
            if fs.prepaid_out and fs.sandbox_id:
                self.rt.ledger.refund_out(fs.sandbox_id, fs.prepaid_out)
                fs.prepaid_out = 0
            fs.decision = gateway_deny(Reason.AUDIT_UNAVAILABLE)
        return fs.decision

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        fs = ensure_flow_state(flow, "connect")
        decision = await self._record(EventKind.CONNECT, flow, fs)
        if not decision.allowed or fs.pinned is None:
            flow.response = deny_response(
                decision if not decision.allowed else gateway_deny(Reason.INVALID_REQUEST), fs.request_id
            )
            return
        conn = self.rt.conn(flow.client_conn.id)
        conn.tunnel_host, conn.tunnel_port = fs.host, fs.port
        conn.tunnel_as_sent = fs.target_as_sent
        conn.tunnel_target = fs.pinned
        conn.intercept = bool(fs.extra.get("intercept", True))
        conn.passthrough = decision.passthrough  # spliced after passthrough.py's SNI check
        if not conn.intercept:
            conn.allow_tcp(decision.rule_id, fs.request_id)  # a raw-TCP or passthrough rule: relay, no MITM
        raw = fs.extra.get("raw_address")
        if raw is not None:
            conn.tunnel_raw_address = (raw[0], raw[1])
            conn.approved[(raw[0], raw[1])] = fs.pinned

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        fs = ensure_flow_state(flow, "http_request")
        if flow.response is not None and fs.audited:
            return
        fs.extra["bodyless_request_hash"] = request_hash.bodyless_hash(flow.request, fs)
        decision = await self._record(EventKind.HTTP_REQUEST, flow, fs)
        if not decision.allowed:
            flow.request.stream = False
            if pending_body_too_large(flow.request):
                # mitmproxy would buffer the whole body before sending our response (a sandbox could
                # make the gateway hold gigabytes per connection): kill instead. The deny is audited;
                # the client sees the connection (HTTP/1) or the stream (HTTP/2) reset.
                fs.extra["killed_unread_body"] = True
                flow.kill()
                return
            flow.response = deny_response(decision, fs.request_id)
            return
        request_hash.start(flow.request, fs)
        conn = self.rt.conn(flow.client_conn.id)
        raw = fs.extra.get("raw_address")
        if raw is not None and fs.pinned is not None:
            conn.approved[(raw[0], raw[1])] = fs.pinned
        if fs.sandbox_id is not None and fs.host is not None:
            try:
                await self.rt.state.record_request(fs.sandbox_id, fs.host, decision.rule_id, fs.prepaid_out)
            except StateUnavailable:
                logger.error("could not record request history for %s", fs.sandbox_id)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is not None and flow.response is not None and fs.decision is not None:
            flow.response.headers[REQUEST_ID_HEADER] = fs.request_id

    async def _outcome(self, flow: http.HTTPFlow, error: str | None = None) -> None:
        fs = flow_state(flow)
        if fs is None or fs.outcome_sent or fs.decision is None or not fs.decision.allowed:
            return
        fs.outcome_sent = True
        extra: dict = {}
        if error:
            extra["egressgate.error"] = error
        if fs.extra.get("budget_cut"):
            extra["egressgate.budget_cut"] = True
        if fs.extra.get("internal_error"):
            extra["egressgate.internal_error"] = fs.extra["internal_error"]  # the hook that crashed
        if fs.extra.get("response_refused"):  # credential_response.py: why the body was not forwarded
            extra["egressgate.response_refused"] = fs.extra["response_refused"]
        if fs.extra.get("request_refused"):  # http1_framing.py: the request body's framing was refused
            extra["egressgate.request_refused"] = fs.extra["request_refused"]
        if fs.extra.get(TRANSPARENT):
            extra.update(fs.extra[TRANSPARENT])
        req_hash, body_hash = request_hash.finish(fs)
        event = AuditEvent(
            kind=EventKind.OUTCOME,
            time_ns=time.time_ns(),
            request_id=fs.request_id,
            sandbox_id=fs.sandbox_id,
            decision=str(fs.decision.effect),
            reason=str(Reason.BUDGET_EXCEEDED) if fs.extra.get("budget_cut") else str(fs.decision.reason),
            rule_id=fs.decision.rule_id,
            policy_name=fs.policy_name,
            policy_hash=fs.policy_hash,
            host=fs.host,
            port=fs.port,
            status=flow.response.status_code if flow.response is not None else None,
            bytes_out=fs.bytes_out,
            bytes_in=fs.bytes_in,
            duration_ms=(time.time_ns() - fs.started_ns) / 1e6,
            request_hash=req_hash,
            body_hash=body_hash,
            extra=extra,
        )
        self._write_behind(event)

    def refused(self, flow: http.HTTPFlow, hook: str) -> None:
        """An addon crashed and failclosed.py refused the flow (500 `internal_error`, or a kill).

        Not yet audited: the refusal is the flow's decision and is recorded as one, write-behind (a deny
        takes effect whether or not its record could be written), under the flow's request id, which is
        the one the 500 body carries. Already audited (the crash came after the decision record): the
        outcome record, under the same id, says `internal_error`."""
        fs = ensure_flow_state(flow, "connect" if flow.request.method == "CONNECT" else "http_request")
        fs.extra["internal_error"] = hook
        if fs.audited:
            return
        earlier = fs.decision
        fs.decision = gateway_deny(
            Reason.INTERNAL_ERROR,
            detail=f"hook={hook}" + (f"; earlier={earlier.reason}" if earlier is not None else ""),
            rule_id=earlier.rule_id if earlier is not None else None,
        )
        fs.audited = True
        try:
            note_target(self.rt, flow, fs)  # the crash may have come before the target was filled in
        except Exception:
            logger.exception("could not describe the target of a refused flow")
        conn = self.rt.conns.get(flow.client_conn.id)
        client = flow.client_conn.peername[0] if flow.client_conn.peername else None
        mark_transparent(conn, fs)
        kind = EventKind.CONNECT if fs.kind == "connect" else EventKind.HTTP_REQUEST
        self._write_behind(decision_event(kind, fs, conn.labels if conn is not None else {}, client))

    def _write_behind(self, event: AuditEvent) -> None:
        """Outcome records are written without holding the response: intent-before-effect is the
        decision record's job, and it was durable before anything went upstream. An outcome cannot be
        denied (the exchange happened) and may hold the only request hash of a streamed body, so it goes
        through `write_after`: a failed write is queued and retried, never dropped (the sink logs the
        request id; a full retry queue makes the sink unhealthy, so *new* requests are denied). The task
        is tracked and drained at shutdown."""
        task = asyncio.get_running_loop().create_task(self.rt.audit.write_after(event))
        self.rt.background.add(task)
        task.add_done_callback(self.rt.background.discard)

    def request(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is not None and fs.decision is not None and fs.decision.allowed:
            request_hash.feed_buffered(flow.request, fs)

    async def response(self, flow: http.HTTPFlow) -> None:
        await self._outcome(flow)

    async def error(self, flow: http.HTTPFlow) -> None:
        await self._outcome(flow, flow.error.msg if flow.error else "error")

    async def websocket_end(self, flow: http.HTTPFlow) -> None:
        """One more `outcome` record (same request id) when a websocket ends: the frame bytes of the
        session after the 101 (whose own outcome was written with the response), how it was closed and,
        when the gateway closed it (ws_layer.Refusal: budget, message size, phantom, internal error),
        the reason code with decision `deny`. Awaited: the record is durable before the flow is done."""
        fs = flow_state(flow)
        if fs is None or flow.websocket is None or flow.metadata.get(WS_AUDITED):
            return
        flow.metadata[WS_AUDITED] = True
        refusal = ws_layer.refusal_of(flow)
        extra: dict = {"egressgate.websocket.close_code": int(flow.websocket.close_code or 0),
                       "egressgate.websocket.closed_by": "gateway" if refusal is not None
                       else "client" if flow.websocket.closed_by_client else "server"}
        if refusal is not None and refusal.detail:
            extra["egressgate.detail"] = refusal.detail
        if refusal is not None and refusal.reason == Reason.BUDGET_EXCEEDED:
            extra["egressgate.budget_cut"] = True
        rule = fs.decision.rule_id if fs.decision is not None else None
        await self._write(AuditEvent(
            kind=EventKind.OUTCOME, time_ns=time.time_ns(), request_id=fs.request_id, sandbox_id=fs.sandbox_id,
            decision="deny" if refusal is not None else "allow",
            reason=str(refusal.reason) if refusal is not None else str(Reason.RULE_MATCHED), rule_id=rule,
            policy_name=fs.policy_name, policy_hash=fs.policy_hash, scheme=fs.scheme, host=fs.host, port=fs.port,
            status=101, bytes_out=fs.extra.get(WS_OUT, 0), bytes_in=fs.extra.get(WS_IN, 0),
            duration_ms=(time.time_ns() - fs.started_ns) / 1e6,
            message=refusal.message if refusal is not None else None, extra=extra,
        ))

    async def tcp_end(self, flow: tcp.TCPFlow) -> None:
        await self._tcp_outcome(flow)

    async def tcp_error(self, flow: tcp.TCPFlow) -> None:
        await self._tcp_outcome(flow)

    async def _tcp_outcome(self, flow: tcp.TCPFlow) -> None:
        conn = self.rt.conns.get(flow.client_conn.id)
        if conn is None or conn.tcp_allowed_rule is None or flow.metadata.get("egressgate.outcome"):
            return
        flow.metadata["egressgate.outcome"] = True
        out = flow.metadata.get(TCP_OUT, 0)
        in_ = flow.metadata.get(TCP_IN, 0)
        self._write_behind(
            AuditEvent(
                kind=EventKind.OUTCOME, time_ns=time.time_ns(),
                request_id=conn.tcp_request_id or _orphan_id(flow),
                sandbox_id=conn.sandbox_id, decision="allow", reason=str(Reason.RULE_MATCHED),
                rule_id=conn.tcp_allowed_rule, host=conn.tunnel_host, port=conn.tunnel_port, scheme="tcp",
                bytes_out=out, bytes_in=in_,
                extra={**({"egressgate.budget_cut": True} if flow.metadata.get(TCP_CUT) else {}),
                       **transparent_attributes(conn)},
            )
        )
