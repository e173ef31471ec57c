"""The answer side of a remote MCP route (the McpRoute addon's response hooks; mcp/route.py has the
request side and the route's rules).

Every answer on the route is read before the sandbox gets it: `Accept-Encoding: identity` was asked for,
so a coded answer is refused (502, `egressgate.response_refused`); an SSE answer (streamable HTTP POST
or GET stream, the HTTP+SSE transport's stream) is filtered per event and a JSON answer whole
(mcp/stream.py). This side only plans: the filter is `FlowState.answer_filter`, which compose.py puts
in its stated place when Enforce (the next addon) builds the answer's one callable — after the byte
counter and the credential scrub, which still see the upstream's bytes first, and before a re-scrub of
what the filter re-encoded; a refused or replaced answer is `FlowState.replacement`. The gateway's own
denials for members of the POST that did not go upstream are merged in. An answer of another content
type could carry anything: refused. The HTTP+SSE transport's session lives as
long as its stream (`response` / `error` end it). When a streamable-HTTP POST's exchange ends (`response`
after the whole answer, streamed or not, or `error`), the ids of the requests it forwarded and that were
not answered are freed (McpSession.release): an HTTP error or a 202 never answers them, and keeping them
would refuse the client's retry and fill the session's bound. HTTP+SSE POSTs are never freed this way
(their answers come on the stream), and nothing is freed while an SSE answer is still open.
"""

from __future__ import annotations

import logging
from urllib.parse import urljoin

from mitmproxy import http

from egressgate.broker.redact import cached_scrubber
from egressgate.gateway.mcp.headers import HeaderView
from egressgate.gateway.mcp.sessions import McpExchange
from egressgate.gateway.mcp.stream import json_answer, json_collector, sse_filter
from egressgate.gateway.shared.compose import AnswerFilter
from egressgate.gateway.shared.context import FlowState, flow_state
from egressgate.gateway.shared.credential_streams import reframe
from egressgate.gateway.shared.credential_streams import refuse as refuse_response
from egressgate.gateway.shared.deny import REQUEST_ID_HEADER
from egressgate.gateway.shared.emit import flow_outcome_event, write_outcome
from egressgate.mcp.jsonrpc import McpMalformed, dumps
from egressgate.policy.canon import CanonError
from egressgate.policy.decide import decide
from egressgate.policy.facts import Facts, Operation
from egressgate.policy.target import parse_url

logger = logging.getLogger(__name__)


class McpAnswers:
    """Mixin of McpRoute: `self.rt` (Runtime) and `self.sessions` (McpSessions) come from it."""

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        ex = fs.mcp if fs is not None else None
        resp = flow.response
        if ex is not None and resp is not None:
            ex.status = resp.status_code  # the upstream's, before a merged answer replaces it
        if (ex is None or ex.answered or resp is None or fs.decision is None or not fs.decision.allowed
                or fs.replacement is not None or ex.role == "other"):
            return
        ok = 200 <= resp.status_code < 300
        if ex.role == "delete":
            if ok and ex.key is not None:
                self.sessions.end(ex.key)
            return
        h = HeaderView(resp)  # read once (mcp/headers.py)
        sid = h.get(b"mcp-session-id")
        if ex.server.transport != "sse" and sid and fs.sandbox_id is not None:
            self.sessions.assign(ex.server.name, sid, fs.sandbox_id)
        if ex.server.transport != "sse" and ex.key is not None and sid and ex.key[2] != sid:
            new = (ex.key[0], ex.key[1], sid)
            self.sessions.rekey(ex.key, new)
            ex.key = new
        if ex.session is None or not (ok or ex.replies):
            return  # the server's own error (no session, bad request): nothing of a tool's answer in it
        bodiless = flow.request.method == "HEAD" or resp.status_code in (204, 304)
        ctype = h.content_type()
        if h.coded():
            self._refuse_answer(flow, fs, "mcp_coded_answer", "The MCP server compressed its answer although "
                                "the gateway asked for none; it was refused.", bodiless)
            return
        policy = self.rt.policies.get(fs.policy_name)
        max_bytes = policy.mcp.max_message_bytes if policy is not None else 0
        refuse = self._stream_refusal(flow, fs)
        rescrub = cached_scrubber(fs.credential.spec()) if fs.credential is not None else None
        if ctype == "text/event-stream":
            on_endpoint = None
            if ex.role == "stream" and ex.server.transport == "sse":
                assert ex.key is not None
                self.sessions.put(ex.key, ex.session, ex.injector)
                on_endpoint = self._endpoint_check(fs, ex, policy)
            reframe(flow)
            first, ex.replies = ex.replies, []
            session, injector = ex.session, ex.injector if ex.role == "stream" else None
            fs.answer_filter = AnswerFilter(
                lambda inner: sse_filter(inner, session, max_bytes, first, injector, on_endpoint, refuse), rescrub)
            fs.stream_response = True
            return
        if ex.role == "post" and ctype == "application/json":
            if fs.stream_response:  # large or of unknown length: collected (bounded) by the filter
                reframe(flow)
                session, replies, batch = ex.session, ex.replies, ex.batch
                fs.answer_filter = AnswerFilter(lambda inner: json_collector(
                    inner, max_bytes, lambda body: json_answer(session, body, max_bytes, replies, batch), refuse),
                    rescrub)
            return  # buffered: filtered whole in `response`
        if ex.role == "post" and ex.replies and (resp.status_code == 202 or not ok):  # no answer of its own
            body = dumps(ex.replies if ex.batch or len(ex.replies) > 1 else ex.replies[0])
            resp.status_code, resp.reason = 200, "OK"
            resp.headers = http.Headers(content_type="application/json", cache_control="no-store",
                                        content_length=str(len(body)))
            resp.headers[REQUEST_ID_HEADER] = fs.request_id
            fs.replacement = body  # compose.py streams it instead of the upstream's body
            return
        if bodiless or resp.status_code == 202:
            return
        self._refuse_answer(flow, fs, "mcp_unexpected_content_type", f"The MCP server answered with "
                            f"{ctype or 'no content type'}, which the gateway cannot inspect; it was refused.",
                            bodiless)

    def _refuse_answer(self, flow: http.HTTPFlow, fs: FlowState, reason: str, message: str, bodiless: bool) -> None:
        fs.response_refused = reason
        fs.replacement = refuse_response(flow, fs.request_id, reason, message, bodiless)  # compose.py sends it
        fs.stream_response = True

    def _stream_refusal(self, flow: http.HTTPFlow, fs: FlowState):
        client_id = flow.client_conn.id

        def refuse(why: str) -> None:
            fs.response_refused = why  # the outcome record says why the stream was cut
            if self.rt.abort_connection is not None:
                self.rt.abort_connection(client_id)
            elif flow.killable:
                flow.kill()

        return refuse

    def _endpoint_check(self, fs: FlowState, ex: McpExchange, policy):
        """The HTTP+SSE transport's `endpoint` event: where the client will POST its messages. It must be
        on the server's own origin (scheme, host, port) and a path the sandbox may POST to, else the
        client would send its tool calls somewhere this route does not mediate."""
        server = ex.server

        def check(data: bytes) -> bool:
            try:
                url = parse_url(urljoin(server.url, data.decode("utf-8")))
            except (UnicodeDecodeError, CanonError, ValueError):
                return False
            if (url.scheme, url.host, url.port) != (server.scheme, server.host, server.port):
                logger.warning("MCP server %s announced a message endpoint on another origin", server.name)
                return False
            facts = Facts(operation=Operation.HTTP_REQUEST, host=url.host, port=url.port, scheme=url.scheme,
                          method="POST", path=url.path)
            if fs.state is None or not decide(policy, facts, fs.state, self.rt.clock()).allowed:
                return False
            assert ex.key is not None
            self.sessions.announce(ex.key, url.path, url.query or "")
            return True

        return check

    def response(self, flow: http.HTTPFlow) -> None:
        """The whole answer went (streamed ones too: mitmproxy calls this at their end): filter a buffered
        JSON answer, then free what this POST left unanswered."""
        fs = flow_state(flow)
        ex = fs.mcp if fs is not None else None
        try:
            self._answer_done(flow, fs, ex)
        finally:
            if ex is not None and ex.ticket is not None:
                status = ex.status if ex.status is not None else 0
                why = (f"response_refused={fs.response_refused}" if fs.response_refused
                       else "no_answer" if 200 <= status < 300 and status != 202 else f"http_status={status}")
                ex.session.release(ex.ticket, why)
            self._folded_outcome(flow, fs, ex, None)

    def _folded_outcome(self, flow: http.HTTPFlow, fs: FlowState | None, ex: McpExchange | None,
                        error: str | None) -> None:
        """The POST's outcome record, with its call's outcome (held by the mediator: answered, or
        released `no_response` just above): one outcome record per call (docs/audit.md "MCP"). On the
        HTTP+SSE transport the call's answer comes on the stream, usually after the POST's 202: the POST's
        outcome record then waits in the HeldOutcome and the mediator writes it with the call's outcome
        (or its `no_response` when the session ends first)."""
        if fs is None or ex is None or ex.held is None:
            return
        held, ex.held = ex.held, None
        held.open = False
        if held.event is None and ex.injector is not None and not ex.session.closed:
            held.waiting = flow_outcome_event(self.rt, flow, fs, error)
            return
        write_outcome(self.rt, flow, fs, error, held.event.extra if held.event is not None else None)

    def _answer_done(self, flow: http.HTTPFlow, fs: FlowState | None, ex: McpExchange | None) -> None:
        resp = flow.response
        if ex is None or resp is None or fs.decision is None or not fs.decision.allowed:
            return
        if ex.role == "stream" and ex.server.transport == "sse" and ex.key is not None:
            self.sessions.end(ex.key)  # the HTTP+SSE session lives as long as its stream
            return
        if (ex.role != "post" or ex.answered or resp.stream or fs.replacement is not None or ex.session is None
                or not (200 <= resp.status_code < 300 or ex.replies)):
            return
        h = HeaderView(resp)
        if h.content_type() != "application/json":
            return
        policy = self.rt.policies.get(fs.policy_name)
        max_bytes = policy.mcp.max_message_bytes if policy is not None else 0
        try:
            body = json_answer(ex.session, resp.raw_content or b"", max_bytes, ex.replies, ex.batch)
        except McpMalformed as exc:
            logger.warning("refused an MCP answer from %s: %s", ex.server.name, exc)
            fs.response_refused = "mcp_malformed_server_message"
            flow.response = http.Response.make(502, b"", {"Content-Type": "application/json"})
            flow.response.content = dumps({"error": "upstream_response_refused", "reason": fs.response_refused,
                                           "request_id": fs.request_id, "message": "The MCP server's answer "
                                           "could not be parsed strictly; it was refused."})
            flow.response.headers[REQUEST_ID_HEADER] = fs.request_id
            return
        if fs.credential is not None:
            body = cached_scrubber(fs.credential.spec()).scrub(body)
        if body != resp.raw_content or h.get(b"content-length") != str(len(body)):
            resp.content = body  # else the answer goes out as received (mcp_stream.passthrough)

    def error(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        ex = fs.mcp if fs is not None else None
        if ex is not None and ex.ticket is not None:  # no answer will come for what this POST forwarded
            ex.session.release(ex.ticket, "connection_error")
        self._folded_outcome(flow, fs, ex, flow.error.msg if flow.error else "error")
        if ex is not None and ex.role == "stream" and ex.server.transport == "sse" and ex.key is not None:
            self.sessions.end(ex.key)
