"""Record every decision and every outcome (the audit stage of each decision hook).

Intent before effect: this addon runs after every stage that can decide and before any stage that
gives the decision an effect (pinning.py commits an allowed destination, enforce.py answers a deny).
An allow whose record cannot be made durable becomes a `audit_unavailable` deny here. Outcome records
(status, bytes, duration) follow the response, linked by request id. Records are built by
audit/build.py from the flow's typed state (context.FlowState); nothing else is read.
"""

from __future__ import annotations

import logging

from mitmproxy import http, tcp

from egressgate.audit.build import build
from egressgate.audit.event import AuditEvent, AuditUnavailable, EventKind
from egressgate.gateway.layers import ws_layer
from egressgate.gateway.shared import emit, request_hash
from egressgate.gateway.shared.context import (
    FlowState,
    Runtime,
    ensure_flow_state,
    flow_state,
    new_request_id,
)
from egressgate.gateway.shared.counters import refund_prepaid
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.emit import (
    conn_attributes,
    flow_decision_event,
    outcome_event,
    write_behind,
    write_outcome,
)
from egressgate.gateway.shared.target import note_target
from egressgate.policy.facts import Decision
from egressgate.policy.mcp_decide import mcp_post_server
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)


def _orphan_id(flow: tcp.TCPFlow) -> str:
    """A raw-TCP relay with no recorded decision id cannot happen (ConnState.allow_tcp sets both); if it
    ever does, the outcome is still written, under a fresh id, and the log says so."""
    logger.error("raw TCP outcome for client %s has no decision request id", flow.client_conn.id)
    return new_request_id()


class Record:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def _write(self, event: AuditEvent) -> bool:
        try:
            await emit.write(self.rt, event)
            return True
        except AuditUnavailable as exc:
            logger.error("audit sink unavailable: %s", exc)
            return False

    async def _record(self, kind: EventKind, flow: http.HTTPFlow, fs: FlowState) -> Decision:
        """Write the decision; return the decision to enforce (audit failure turns allow into deny)."""
        if fs.decision is None:  # no addon decided: fail closed
            fs.decision = gateway_deny(Reason.INVALID_REQUEST, "The gateway could not decide this request.")
        if kind is EventKind.HTTP_REQUEST and self._owed(flow, fs):
            return fs.decision
        ok = await self._write(flow_decision_event(self.rt, flow, fs, kind))
        fs.audited = True
        if not ok and fs.decision.allowed:
            refund_prepaid(self.rt, fs)  # nothing goes upstream
            fs.decision = gateway_deny(Reason.AUDIT_UNAVAILABLE)
        return fs.decision

    def _owed(self, flow: http.HTTPFlow, fs: FlowState) -> bool:
        """An allowed POST of JSON-RPC messages to a remote MCP server: its body is buffered and decided
        by the MCP route (mcp/route.py) before anything goes upstream, so its decision record is deferred
        there and folded into the `mcp_tool_call` record of the call it carries (one record per call,
        docs/audit.md "MCP"); the route writes it durably itself before forwarding anything else, and
        `write_owed` covers a flow that ends first. Pinning may commit the destination meanwhile
        (`audited`): nothing is sent on it before the route's `request` hook."""
        d = fs.decision
        if (d is None or not d.allowed or flow.response is not None or fs.scheme is None or fs.host is None
                or fs.port is None or fs.path is None or fs.method is None):
            return False
        policy = self.rt.policies.get(fs.policy_name)
        if policy is None or not policy.mcp.by_origin:
            return False
        if mcp_post_server(policy, fs.scheme, fs.host, fs.port, fs.method, fs.path) is None:
            return False
        fs.audited = fs.record_owed = True
        return True

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        await self._record(EventKind.CONNECT, flow, ensure_flow_state(flow))

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        fs = ensure_flow_state(flow)
        if fs.audited:  # answered earlier, or a request in a refused tunnel (its CONNECT's record is its record)
            return
        fs.bodyless_hash = request_hash.bodyless_hash(flow.request, fs)
        await self._record(EventKind.HTTP_REQUEST, flow, fs)

    async def _outcome(self, flow: http.HTTPFlow, error: str | None = None) -> None:
        fs = flow_state(flow)
        if fs is None or fs.outcome_folded:  # the MCP route writes it, with its call's outcome
            return
        write_outcome(self.rt, flow, fs, error)

    def refused(self, flow: http.HTTPFlow, hook: str) -> None:
        """An addon crashed and failclosed.py refused the flow (500 `internal_error`, or a kill).

        Not yet audited: the refusal is the flow's decision and is recorded as one, write-behind (a deny
        takes effect whether or not its record could be written), under the flow's request id, which is
        the one the 500 body carries. Already audited (the crash came after the decision record): the
        outcome record, under the same id, says `internal_error`."""
        fs = ensure_flow_state(flow)
        fs.internal_error = hook
        if fs.audited and not fs.record_owed:
            return
        fs.record_owed = False  # the refusal below is this flow's decision record
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
        kind = EventKind.CONNECT if flow.request.method == "CONNECT" else EventKind.HTTP_REQUEST
        write_behind(self.rt, flow_decision_event(self.rt, flow, fs, kind))

    def request(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is not None and fs.decision is not None and fs.decision.allowed:
            request_hash.feed_buffered(flow.request, fs)

    async def response(self, flow: http.HTTPFlow) -> None:
        await self._outcome(flow)

    async def error(self, flow: http.HTTPFlow) -> None:
        await self._outcome(flow, flow.error.msg if flow.error else "error")

    async def http_connect_error(self, flow: http.HTTPFlow) -> None:
        """An allowed CONNECT that was not established (the eager upstream connection failed: mitmproxy
        answers 502 and no other hook sees the flow again): its allow record gets its outcome, with why."""
        why = flow.error.msg if flow.error else (flow.server_conn.error or "upstream connection failed")
        await self._outcome(flow, why)

    async def websocket_end(self, flow: http.HTTPFlow) -> None:
        """One more `outcome` record (same request id) when a websocket ends: the frame bytes of the
        session after the 101 (whose own outcome was written with the response), how it was closed and,
        when the gateway closed it (flowtypes.WsRefusal: budget, message size, phantom, internal error),
        the reason code with decision `deny`. Awaited: the record is durable before the flow is done."""
        fs = flow_state(flow)
        if fs is None or flow.websocket is None or fs.ws_audited:
            return
        fs.ws_audited = True
        refusal = ws_layer.refusal_of(flow)
        extra: dict = {"egressgate.websocket.close_code": int(flow.websocket.close_code or 0),
                       "egressgate.websocket.closed_by": "gateway" if refusal is not None
                       else "client" if flow.websocket.closed_by_client else "server"}
        if refusal is not None and refusal.detail:
            extra["egressgate.detail"] = refusal.detail
        if refusal is not None and refusal.reason == Reason.BUDGET_EXCEEDED:
            extra["egressgate.budget_cut"] = True
        await self._write(outcome_event(
            fs, decision="deny" if refusal is not None else "allow",
            reason=str(refusal.reason) if refusal is not None else str(Reason.RULE_MATCHED),
            rule_id=fs.decision.rule_id if fs.decision is not None else None, scheme=fs.scheme,
            status=101, bytes_out=fs.ws_out, bytes_in=fs.ws_in,
            message=refusal.message if refusal is not None else None, extra=extra,
        ))

    async def tcp_end(self, flow: tcp.TCPFlow) -> None:
        await self._tcp_outcome(flow)

    async def tcp_error(self, flow: tcp.TCPFlow) -> None:
        await self._tcp_outcome(flow)

    async def _tcp_outcome(self, flow: tcp.TCPFlow) -> None:
        conn = self.rt.conns.get(flow.client_conn.id)
        fs = ensure_flow_state(flow)
        if conn is None or conn.tcp_allowed_rule is None or fs.outcome_sent:
            return
        fs.outcome_sent = True
        extra: dict = {"egressgate.budget_cut": True} if fs.budget_cut else {}
        extra.update(conn_attributes(conn))
        write_behind(self.rt, build(  # a relay the store's failure cut (budgets.py) is a deny, and says so
            EventKind.OUTCOME, request_id=conn.tcp_request_id or _orphan_id(flow), sandbox_id=conn.sandbox_id,
            decision="deny" if fs.state_cut else "allow",
            reason=str(Reason.STATE_UNAVAILABLE if fs.state_cut else Reason.RULE_MATCHED),
            rule_id=conn.tcp_allowed_rule,
            host=conn.tunnel_host, port=conn.tunnel_port, scheme="tcp", bytes_out=fs.bytes_out,
            bytes_in=fs.bytes_in, extra=extra,
        ))
