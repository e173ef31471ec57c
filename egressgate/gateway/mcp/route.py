"""Remote MCP: a request to a URL of a policy's `mcp.servers` entry is an MCP route (PLAN-13).

The network decision came first (decision.py: the server is reached only through an allowed network rule,
credentials injected by that rule, the allow recorded, the destination pinned); this addon runs right
before Enforce and adds the tool-level mediation on top, through the session's mediator
(egressgate/mcp/mediator.py). Before Enforce because Enforce builds the body callables (compose.py, the
one place they are built) and this route only *plans* its part of them: a POST body buffered
(`stream_request` off), a body refused on a request that may carry none (`forbid_body`), the answer
filter (`answer_filter`, mcp/answer.py).

- A POST carries JSON-RPC messages. Its body is buffered whole (at most `mcp.max_message_bytes`, with a
  declared length and no content coding: anything else is refused before a byte goes upstream), parsed
  strictly and decided per message by `from_client`. What is forwarded is the mediator's canonical
  re-serialization of the allowed messages only, so the server parses exactly what was decided; denied
  messages are answered by the gateway as JSON-RPC errors (HTTP 200 for streamable HTTP; the HTTP+SSE
  transport answers on its stream, mcp_stream.Injector). A body that does not parse is refused whole
  (HTTP 400, -32700/-32600, reason `mcp_malformed`).
- Any other request on the route (GET stream, DELETE, ...) must not carry a body: a JSON-RPC message in
  a GET or PUT body would reach the server unmediated.
- Answers: `Accept-Encoding: identity` is asked for and a coded answer refused (it could not be read);
  JSON answers and SSE events are filtered by mcp/stream.py before the sandbox sees them.

Refusals made here turn the flow's allow into a deny with its own decision record (phase `mcp`), like
enforce.py's history refusal; the prepaid bytes go back since nothing went upstream.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from mitmproxy import http

from egressgate.audit.build import build
from egressgate.audit.event import AuditUnavailable, EventKind
from egressgate.gateway.mcp.answer import McpAnswers
from egressgate.gateway.mcp.headers import HeaderView
from egressgate.gateway.mcp.sessions import McpExchange, McpSessions
from egressgate.gateway.mcp.stream import Injector
from egressgate.gateway.shared import emit
from egressgate.gateway.shared.compose import buffer_body
from egressgate.gateway.shared.context import FlowState, Runtime, flow_state
from egressgate.gateway.shared.counters import refund_prepaid
from egressgate.gateway.shared.deny import DECISION_HEADER, REQUEST_ID_HEADER, gateway_deny
from egressgate.gateway.shared.emit import flow_decision_event, write_behind, write_owed
from egressgate.mcp.facts import FromFlow
from egressgate.mcp.jsonrpc import INVALID_REQUEST, PARSE_ERROR, dumps
from egressgate.mcp.mediator import McpSession
from egressgate.policy.mcp_decide import mcp_server_for
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)

_MALFORMED_CODES = frozenset({INVALID_REQUEST, PARSE_ERROR})
_NO_BODY = "Only a POST carries MCP messages on this route; send this request without a body."


def body_problem(h: HeaderView, max_bytes: int) -> tuple[str, str] | None:
    """Why a POST body on an MCP route cannot be buffered and parsed: (detail, one sentence), or None."""
    if h.coded():
        return "content_encoding", "Send MCP messages uncompressed (no Content-Encoding)."
    if b"transfer-encoding" in h or b"content-length" not in h:
        return "unknown_length", "Send each MCP message with a Content-Length (no chunked or open-ended body)."
    try:
        size = int(h.get(b"content-length") or "")
    except ValueError:
        return "unknown_length", "Send each MCP message with a valid Content-Length."
    if size > max_bytes:
        return "oversized", (f"This MCP message is {size} bytes; at most {max_bytes} (mcp.max_message_bytes) are "
                             "accepted: send smaller messages.")
    return None


def has_body(h: HeaderView) -> bool:
    if b"transfer-encoding" in h:
        return True
    try:
        return int(h.get(b"content-length", "0") or "0") != 0
    except ValueError:
        return True


def _is_malformed(replies: list[dict]) -> bool:
    return bool(replies) and all((r.get("error") or {}).get("code") in _MALFORMED_CODES for r in replies)


class McpRoute(McpAnswers):
    """The addon (master.py, right before Enforce); its answer side is mcp/answer.py."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.sessions = McpSessions()

    async def done(self) -> None:
        """Stop: the open sessions end while the audit sink still runs (their `no_response` outcomes)."""
        await self.sessions.close_all()

    # ------------------------------------------------------------------------------ request side
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if (fs is None or fs.decision is None or not fs.decision.allowed or flow.response is not None
                or fs.scheme is None or fs.host is None or fs.port is None or fs.path is None):
            return
        policy = self.rt.policies.get(fs.policy_name)
        server = mcp_server_for(policy, fs.scheme, fs.host, fs.port, fs.path) if policy is not None else None
        if server is None:
            return
        request = flow.request
        sse = server.transport == "sse"
        if fs.method == "POST" and not (sse and fs.path == server.path):
            role = "post"
        elif fs.method == "GET" and fs.path == server.path:
            role = "stream"
        else:
            role = "delete" if fs.method == "DELETE" and not sse else "other"
        ex = fs.mcp = McpExchange(server=server, role=role)
        h = HeaderView(request)  # read once: every question below is about these headers
        if b"upgrade" in h or request.method.upper() == "CONNECT":  # a WebSocket, h2c, a tunnel:
            self._refuse(flow, fs, "upgrade", "MCP messages on this route must be HTTP requests (streamable HTTP "
                         "or HTTP+SSE); a protocol upgrade would carry them unmediated.")
            return
        if len(h.get_all(b"mcp-session-id")) > 1:  # which one the server reads is its choice, not ours
            self._refuse(flow, fs, "unknown_session", "Send one Mcp-Session-Id header, not several.")
            return
        sid = h.get(b"mcp-session-id")
        owner = self.sessions.owner(server.name, sid) if sid is not None and not sse else None
        if owner is not None and owner != fs.sandbox_id:
            self._refuse(flow, fs, "unknown_session", "This Mcp-Session-Id was issued to another sandbox; start "
                         "a session of your own (initialize without it).")
            return
        request.headers["accept-encoding"] = "identity"  # an answer is read before the sandbox gets it
        max_bytes = policy.mcp.max_message_bytes
        if role != "post":
            if has_body(h):
                self._refuse(flow, fs, "body_not_allowed", _NO_BODY)
                return
            if b"content-length" not in h:  # HTTP/2: a body may still come (compose.py cuts it)
                fs.forbid_body = self._body_cut(flow, fs)
            if role == "stream" and sse:
                ex.key = (fs.sandbox_id, server.name, "sse:" + fs.request_id)
                ex.injector = Injector()
                ex.session = await self._session(flow, fs, policy, server, "sse")
            elif role in ("stream", "delete"):
                ex.key = (fs.sandbox_id, server.name, sid)
                ex.session = self.sessions.get(ex.key) if role == "delete" else await self._keyed(flow, fs, policy)
            return
        problem = body_problem(h, max_bytes)
        if problem is not None:
            detail, message = problem
            self._refuse(flow, fs, detail, message)
            return
        fs.stream_request = False  # buffered (bounded above): decided whole before anything goes upstream
        if sse:
            found = self.sessions.by_endpoint(fs.sandbox_id, server.name, fs.path, fs.query or "")
            if found is None:
                self._refuse(flow, fs, "unknown_session", "No MCP stream of this sandbox announced this message "
                             "endpoint; open the server's SSE stream through the gateway first.")
                return
            ex.session, ex.injector = found
        else:
            ex.key = (fs.sandbox_id, server.name, sid)
            ex.protocol_header = h.get(b"mcp-protocol-version")
            ex.session = await self._keyed(flow, fs, policy)

    def _body_cut(self, flow: http.HTTPFlow, fs: FlowState):
        """A request on an MCP route that is not a POST, of undeclared length (HTTP/2): its headers go
        upstream, but its first body byte cuts it (compose.py forwards none of it): a message there would
        be unmediated."""
        client_id = flow.client_conn.id

        def cut() -> None:
            fs.request_refused = "mcp_body_not_allowed"  # the outcome record says why
            if self.rt.abort_connection is not None:
                self.rt.abort_connection(client_id)

        return cut

    async def _keyed(self, flow: http.HTTPFlow, fs: FlowState, policy) -> object | None:
        ex = fs.mcp
        assert ex is not None and ex.key is not None
        session = self.sessions.get(ex.key)
        if session is None:
            session = await self._session(flow, fs, policy, ex.server, "streamable_http")
            if session is not None:
                self.sessions.put(ex.key, session)
        return session

    async def _session(self, flow: http.HTTPFlow, fs: FlowState, policy, server, transport: str) -> object | None:
        assert fs.sandbox_id is not None
        try:
            sandbox = await self.rt.state.get(fs.sandbox_id)
        except StateUnavailable:
            sandbox = None
        if sandbox is None:
            self._refuse(flow, fs, "sandbox_record", None, reason=Reason.STATE_UNAVAILABLE)
            return None
        secrets = (fs.credential.spec(),) if fs.credential is not None else ()  # redacted from recorded arguments
        return McpSession(self.rt, policy, server, sandbox, transport, secrets=secrets)

    async def request(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        ex = fs.mcp if fs is not None else None
        if (ex is None or ex.role != "post" or ex.session is None or flow.response is not None
                or fs.decision is None or not fs.decision.allowed):
            return
        body = flow.request.raw_content or b""
        conn = self.rt.conns.get(flow.client_conn.id)
        via = None
        if conn is not None and not conn.closed:  # closed: revoked meanwhile (the mediator re-reads)
            # the POST's decision record goes into its first call's (HTTP+SSE too: the answer comes on the
            # stream's flow, and the POST's outcome waits for it, mcp/answer.py)
            via = FromFlow(flow_decision_event(self.rt, flow, fs) if fs.record_owed else None, conn.labels,
                           fs.state, fs.policy_hash)
        verdict = await ex.session.from_client(body, via, ex.protocol_header)
        ex.batch = verdict.batch
        replies = list(verdict.replies)
        if verdict.folded:
            fs.record_owed = False  # the call's mcp_tool_call record is this POST's record
            if via is not None and via.held is not None:  # forwarded: its outcome goes into the POST's
                ex.held, fs.outcome_folded = via.held, True
        upstream = verdict.forward is not None or (ex.injector is not None and replies and not _is_malformed(replies))
        if fs.record_owed and upstream and not await self._write_owed(flow, fs, ex, verdict):
            return
        write_owed(self.rt, flow, fs)  # nothing goes upstream on this POST: written behind
        if verdict.forward is None:
            if ex.injector is not None and replies and not _is_malformed(replies):
                flow.request.content = ex.injector.ping(replies)  # the stream carries the denials
                return
            self._answer(flow, fs, ex, replies)
            return
        if verdict.forward != body:  # identical bytes (a compact client) need no rewrite
            flow.request.content = verdict.forward  # exactly what was decided (also sets Content-Length)
        if ex.injector is not None:
            ex.injector.queue(replies)  # HTTP+SSE: answers come on the stream, never freed per POST
        else:
            ex.replies = replies
            ex.ticket = verdict.ticket  # freed when this POST's exchange ends (mcp/answer.py)

    async def _write_owed(self, flow: http.HTTPFlow, fs: FlowState, ex: McpExchange, verdict) -> bool:
        """This POST forwards messages but no call's record carried its network decision (no tools/call
        in it, or more than one policy version): its own `http_request` record, durable before anything
        goes upstream (intent before effect). Unrecordable: refused `audit_unavailable`, and the
        requests it reserved are freed."""
        fs.record_owed = False
        try:
            await emit.write(self.rt, flow_decision_event(self.rt, flow, fs))
            return True
        except AuditUnavailable as exc:
            logger.error("audit sink unavailable: %s", exc)
        if verdict.ticket is not None:
            ex.session.release(verdict.ticket, "audit_unavailable")
        self._refuse(flow, fs, "audit", None, reason=Reason.AUDIT_UNAVAILABLE)
        return False

    def _answer(self, flow: http.HTTPFlow, fs: FlowState, ex: McpExchange, replies: list[dict]) -> None:
        """The gateway answers the POST itself: nothing of it went upstream."""
        ex.answered = True
        headers = {"Cache-Control": "no-store", REQUEST_ID_HEADER: fs.request_id}
        if any(isinstance(r.get("error"), dict) and (r["error"].get("data") or {}).get("egressgate") for r in replies):
            headers[DECISION_HEADER] = "deny"
        if not replies:  # only notifications / responses, none forwarded: nothing to answer with
            flow.response = http.Response.make(202, b"", headers)
            return
        headers["Content-Type"] = "application/json"
        body = dumps(replies if ex.batch or len(replies) > 1 else replies[0])
        flow.response = http.Response.make(400 if _is_malformed(replies) else 200, body, headers)

    def _refuse(self, flow: http.HTTPFlow, fs: FlowState, detail: str, message: str | None, *,
                reason: Reason = Reason.MCP_MALFORMED) -> None:
        """Refuse the flow before anything went upstream: its own decision record, the prepayment back,
        and a JSON-RPC error (HTTP 400), sent before any body is read whatever its size (early_answer.py)."""
        allowed = fs.decision
        assert allowed is not None
        fs.record_owed = False  # this refusal is the flow's decision record (record.py deferred the allow)
        refund_prepaid(self.rt, fs)
        fs.decision = replace(gateway_deny(reason, message, detail=detail, rule_id=allowed.rule_id),
                              capability=allowed.capability)
        write_behind(self.rt, build(
            EventKind.HTTP_REQUEST, request_id=fs.request_id, verdict=fs.decision,
            extra={"egressgate.phase": "mcp", **({"egressgate.mcp.server": fs.mcp.server.name} if fs.mcp else {})},
            sandbox_id=fs.sandbox_id, policy_name=fs.policy_name, policy_hash=fs.policy_hash, scheme=fs.scheme,
            host=fs.host, port=fs.port, method=fs.method, path=fs.path, bytes_out=fs.bytes_out,
        ))
        buffer_body(flow.request)  # answered before its body is read (early_answer.py)
        text = fs.decision.message or "Refused by the gateway."
        error = {"jsonrpc": "2.0", "id": None, "error": {
            "code": INVALID_REQUEST if reason is Reason.MCP_MALFORMED else -32001, "message": text,
            "data": {"reason": str(reason), "rule": allowed.rule_id, "egressgate": True}}}
        flow.response = http.Response.make(
            400 if reason is Reason.MCP_MALFORMED else 503, dumps(error),
            {"Content-Type": "application/json", DECISION_HEADER: "deny", REQUEST_ID_HEADER: fs.request_id,
             "Cache-Control": "no-store", "Connection": "close"})
        if fs.mcp is not None:
            fs.mcp.answered = True
