"""The deny contract: status code, `X-Egressgate-Decision: deny`, and DESIGN.md's JSON body.

Agents that get a bare 403 retry around the proxy; a body that says *what is allowed* stops that, so
every deny carries one actionable sentence. The sentence comes from the decision engine (it knows the
rules) or from the gateway for gateway-level checks; it never contains secrets or tokens.
"""

from __future__ import annotations

import json

from mitmproxy import http

from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Effect, Reason

DECISION_HEADER = "X-Egressgate-Decision"
REQUEST_ID_HEADER = "X-Egressgate-Request-Id"

_STATUS = {
    Reason.IDENTITY_UNKNOWN: 407,
    Reason.SANDBOX_REVOKED: 407,
    Reason.IDENTITY_ADDRESS_MISMATCH: 407,
    Reason.BUDGET_EXCEEDED: 429,
    Reason.CONNECTION_LIMIT: 429,
    Reason.HEADER_TOO_LARGE: 431,
    Reason.HOST_MISMATCH: 421,
    Reason.INTERNAL_ERROR: 500,
}

_DEFAULT_MESSAGES = {
    Reason.IDENTITY_UNKNOWN: (
        "Send Proxy-Authorization: Basic base64(sandbox_id:token) as given by `egressgate sandbox admit`."
    ),
    Reason.SANDBOX_REVOKED: "This sandbox was revoked; ask the operator to admit a new one.",
    Reason.BUDGET_EXCEEDED: "The sandbox's outbound byte budget is exhausted; no more data can be sent.",
    Reason.HOST_MISMATCH: (
        "The Host header, TLS SNI and absolute URI must all name the CONNECT target; open a new tunnel "
        "for another host."
    ),
    Reason.AUDIT_UNAVAILABLE: "The audit trail is unavailable, so nothing is allowed; retry later.",
    Reason.STATE_UNAVAILABLE: "The gateway's state store is unavailable, so nothing is allowed; retry later.",
    Reason.POLICY_UNAVAILABLE: "No valid policy is loaded for this sandbox; ask the operator.",
    Reason.PROTOCOL_NOT_ALLOWED: "Only HTTP(S) is allowed here; no rule allows raw TCP to this host:port.",
    Reason.INVALID_REQUEST: "The request could not be parsed unambiguously and was refused.",
    Reason.TRAILERS_NOT_ALLOWED: (
        "Requests with trailers (fields after the body) are refused; send those fields as headers instead."
    ),
    Reason.UPSTREAM_UNRESOLVABLE: "The destination name could not be resolved.",
    Reason.SELF_CONNECTION: "Connections to the gateway's own listeners are not allowed.",
    Reason.INTERNAL_ERROR: "The gateway failed while checking this request, so it was refused; retry later.",
    Reason.CONNECTION_LIMIT: "Too many open connections to the gateway; close idle ones or reuse them, then retry.",
}


def status_for(reason: Reason) -> int:
    return _STATUS.get(reason, 403)


def gateway_deny(reason: Reason, message: str | None = None, detail: str | None = None,
                 rule_id: str | None = None) -> Decision:
    """A Decision for checks the gateway makes itself (identity, consistency, pinning, budgets)."""
    return Decision(
        effect=Effect.DENY,
        reason=reason,
        rule_id=rule_id,
        detail=detail,
        message=message or _DEFAULT_MESSAGES.get(reason, "The request was denied by the egress policy."),
    )


def deny_body(decision: Decision, request_id: str) -> bytes:
    """DESIGN.md's body; an `approval_required` deny also names its approval (`approval_id`, null when
    the sandbox already has too many waiting) so the agent can tell the operator what to approve."""
    message = decision.message or _DEFAULT_MESSAGES.get(decision.reason, "Denied by the egress policy.")
    body = {
        "error": "egress_denied",
        "reason": str(decision.reason),
        "rule": decision.rule_id,
        "request_id": request_id,
        "message": message,
    }
    if decision.reason is Reason.APPROVAL_REQUIRED:
        body["approval_id"] = decision.approval_id
        if decision.approval_kind is not None:  # package_install | publish (an operation class)
            body["approval_kind"] = decision.approval_kind
    return json.dumps(body, separators=(",", ":")).encode()


def deny_response(decision: Decision, request_id: str) -> http.Response:
    status = status_for(decision.reason)
    headers = {
        "Content-Type": "application/json",
        DECISION_HEADER: "deny",
        REQUEST_ID_HEADER: request_id,
        "Cache-Control": "no-store",
        "Connection": "close",
    }
    if status == 407:
        headers["Proxy-Authenticate"] = 'Basic realm="egressgate"'
    return http.Response.make(status, deny_body(decision, request_id), headers)


def raw_deny(decision: Decision, request_id: str) -> bytes:
    """HTTP/1.1 deny bytes for places without an HTTP layer (a refused non-HTTP tunnel)."""
    body = deny_body(decision, request_id)
    status = status_for(decision.reason)
    head = (
        f"HTTP/1.1 {status} Denied\r\nContent-Type: application/json\r\n{DECISION_HEADER}: deny\r\n"
        f"{REQUEST_ID_HEADER}: {request_id}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body
