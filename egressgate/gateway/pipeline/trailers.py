"""Request trailers are refused (`trailers_not_allowed`), on every route, HTTP/1 and HTTP/2 alike.

Why refuse rather than handle: trailers arrive after the body, when a streamed body is already upstream
and every request check (budget prepayment, phantom scan of headers, size limits, the request hash) has
run on the head and the body only. Applying them to trailers too would mean a second budget charge after
the fact, a phantom scan of fields that arrive after the decision was audited, a size limit on a block
mitmproxy buffers whole, and a change to the request hash an auditor recomputes (docs/audit.md) — all for
a feature agents' HTTP clients do not use (browsers and common HTTP libraries never send request
trailers; gRPC's trailers are on responses). One refusal closes the channel: no trailer byte is ever
forwarded, so none needs counting, scanning or hashing.

How the refusal lands (the `request` hook is the first point where trailers are known):
- buffered body: nothing went upstream; the client gets the 403 deny and the prepaid budget is refunded;
- streamed body: the body bytes already forwarded were counted and scanned like any body, but the
  upstream never sees the request complete: GatewayHttpStream (http_layer.py) aborts the upstream request
  when an answer is set here, and the client gets the same 403.
The deny is audited as its own `http_request` record (phase `after_body`), after the allow record written
at the headers; no outcome record follows. Trailer names and values are never logged or audited (a name
may itself be a phantom); only their count and size.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from mitmproxy import http

from egressgate.audit.build import build
from egressgate.audit.event import AuditUnavailable, EventKind
from egressgate.gateway.shared import emit
from egressgate.gateway.shared.context import Runtime, flow_state
from egressgate.gateway.shared.counters import refund_prepaid
from egressgate.gateway.shared.deny import deny_response, gateway_deny
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)


class Trailers:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def request(self, flow: http.HTTPFlow) -> None:
        trailers = flow.request.trailers
        if not trailers:
            return
        fs = flow_state(flow)
        if fs is None or fs.decision is None or not fs.decision.allowed:
            return  # already refused; http_layer.py never forwards trailers of an unanswered flow either
        streamed = bool(flow.request.stream)
        size = sum(len(name) + len(value) + 4 for name, value in trailers.fields)
        detail = f"{len(trailers.fields)} trailer fields, {size} bytes, {'streamed' if streamed else 'buffered'} body"
        if not streamed:
            refund_prepaid(self.rt, fs)  # nothing of it went upstream
        allowed = fs.decision
        fs.decision = replace(gateway_deny(Reason.TRAILERS_NOT_ALLOWED, detail=detail, rule_id=allowed.rule_id),
                              capability=allowed.capability)
        logger.warning("refused request trailers from %s to %s (%s)", fs.sandbox_id, fs.host, detail)
        event = build(
            EventKind.HTTP_REQUEST, request_id=fs.request_id, verdict=fs.decision,
            extra={"egressgate.phase": "after_body"}, sandbox_id=fs.sandbox_id, policy_name=fs.policy_name,
            policy_hash=fs.policy_hash, scheme=fs.scheme, host=fs.host, port=fs.port, method=fs.method,
            path=fs.path, bytes_out=fs.bytes_out,
        )
        try:
            await emit.write(self.rt, event)
        except AuditUnavailable as exc:  # the deny stands either way
            logger.error("refusal of request trailers could not be audited: %s", exc)
        if flow.response is None:
            flow.response = deny_response(fs.decision, fs.request_id)
        else:  # the upstream answered before the request ended: its response is cut, the request reset
            flow.kill()
