"""Make a recorded decision take effect on the flow: answer a deny, wire up an allow.

Runs after record.py (the decision is durable, or was turned into `audit_unavailable`) and pinning.py
(an allowed destination is committed). A deny is answered with the deny contract whether or not its
record could be written; an allow gets its body stream callables, built once by compose.py from what the
earlier stages planned, its request hash and its request history.
"""

from __future__ import annotations

import logging

from mitmproxy import http

from egressgate.gateway import request_hash
from egressgate.gateway.budgets import in_counter, out_counter, outbound_limit
from egressgate.gateway.compose import compose_request, compose_response
from egressgate.gateway.context import Runtime, flow_state
from egressgate.gateway.credentials import stream_misuse
from egressgate.gateway.deny import REQUEST_ID_HEADER, deny_response, gateway_deny
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)

DENY_BUFFER_MAX = 64 * 1024


def pending_body_too_large(request: http.Request) -> bool:
    """A body that is still to come and is chunked or declared larger than we are willing to buffer."""
    if "transfer-encoding" in request.headers:
        return True
    try:
        return int(request.headers.get("content-length", "0")) > DENY_BUFFER_MAX
    except ValueError:
        return True


class Enforce:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def http_connect(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is None or fs.decision is None:  # record.py decides every flow; fail closed all the same
            flow.response = deny_response(gateway_deny(Reason.INVALID_REQUEST), fs.request_id if fs else "-")
            return
        if not fs.decision.allowed or fs.pinned is None:
            flow.response = deny_response(
                fs.decision if not fs.decision.allowed else gateway_deny(Reason.INVALID_REQUEST), fs.request_id
            )

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is None or fs.decision is None:
            if flow.response is None:
                flow.response = deny_response(gateway_deny(Reason.INVALID_REQUEST), fs.request_id if fs else "-")
            return
        if flow.response is not None:
            return  # answered earlier (an earlier refusal, already audited)
        decision = fs.decision
        if not decision.allowed:
            flow.request.stream = False
            if pending_body_too_large(flow.request):
                # mitmproxy would buffer the whole body before sending our response (a sandbox could
                # make the gateway hold gigabytes per connection): kill instead. The deny is audited;
                # the client sees the connection (HTTP/1) or the stream (HTTP/2) reset.
                flow.kill()
                return
            flow.response = deny_response(decision, fs.request_id)
            return
        request_hash.start(flow.request, fs)
        if fs.stream_request:
            counter = (out_counter(self.rt, fs, flow.client_conn.id, outbound_limit(self.rt, fs))
                       if fs.meter_request else None)
            flow.request.stream = compose_request(
                fs.hasher, lambda hits: stream_misuse(self.rt, flow, fs, hits), counter)
        if fs.sandbox_id is not None and fs.host is not None:
            try:
                await self.rt.state.record_request(fs.sandbox_id, fs.host, decision.rule_id, fs.prepaid_out)
            except StateUnavailable:
                logger.error("could not record request history for %s", fs.sandbox_id)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        if fs is None or flow.response is None or fs.decision is None:
            return
        flow.response.headers[REQUEST_ID_HEADER] = fs.request_id  # joins the response to its records
        if not fs.decision.allowed:
            return
        if fs.stream_response or fs.replacement is not None:
            counter = in_counter(self.rt, fs) if fs.sandbox_id is not None else None
            flow.response.stream = compose_response(counter, fs.scrub, fs.replacement)
