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
# The body's fields again as headers: clients of a refused CONNECT (curl, requests, git) never show its
# body, but `curl -v`/`-D`, an SDK's exception and a proxy log show headers (docs/policy.md, "Deny responses")
REASON_HEADER = "X-Egressgate-Reason"
RULE_HEADER = "X-Egressgate-Rule"
APPROVAL_HEADER = "X-Egressgate-Approval-Id"
MESSAGE_HEADER = "X-Egressgate-Message"
_MESSAGE_HEADER_MAX = 400

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


def _visible(text: str, limit: int) -> str:
    """`text` as a header value or reason phrase: printable ASCII only (RFC 9110 field-vchar; a name or
    message with other characters never breaks the response head), at most `limit` characters."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:limit]


def deny_headers(decision: Decision, request_id: str) -> dict[str, str]:
    """The deny contract's headers: decision, request id, and the body's reason, rule, approval id and
    message, so a client that shows only the head (any refused CONNECT) still shows why."""
    headers = {DECISION_HEADER: "deny", REQUEST_ID_HEADER: request_id, REASON_HEADER: str(decision.reason)}
    if decision.rule_id:
        headers[RULE_HEADER] = decision.rule_id
    if decision.reason is Reason.APPROVAL_REQUIRED and decision.approval_id:
        headers[APPROVAL_HEADER] = decision.approval_id
    message = decision.message or _DEFAULT_MESSAGES.get(decision.reason, "Denied by the egress policy.")
    headers[MESSAGE_HEADER] = _visible(message, _MESSAGE_HEADER_MAX)
    return headers


def reason_phrase(decision: Decision, status: int, request_id: str) -> str:
    """The status line's reason phrase names the refusal: Python's http.client, requests, httpx, urllib3
    and pip put it in the exception of a refused CONNECT ("Tunnel connection failed: 403 egress denied:
    host_not_allowed ..."), the one place those clients show anything of the gateway's answer."""
    parts = [f"egress denied: {decision.reason}"]
    if decision.rule_id:
        parts.append(f"rule={decision.rule_id}")
    if decision.reason is Reason.APPROVAL_REQUIRED and decision.approval_id:
        parts.append(f"approval_id={decision.approval_id}")
    parts.append(f"request_id={request_id}")
    return _visible(" ".join(parts), 300)


def deny_response(decision: Decision, request_id: str) -> http.Response:
    status = status_for(decision.reason)
    headers = {
        "Content-Type": "application/json",
        **deny_headers(decision, request_id),
        "Cache-Control": "no-store",
        "Connection": "close",
    }
    if status == 407:
        headers["Proxy-Authenticate"] = 'Basic realm="egressgate"'
    response = http.Response.make(status, deny_body(decision, request_id), headers)
    response.reason = reason_phrase(decision, status, request_id)
    return response


def raw_deny(decision: Decision, request_id: str) -> bytes:
    """HTTP/1.1 deny bytes for places without an HTTP layer (a refused non-HTTP tunnel)."""
    body = deny_body(decision, request_id)
    status = status_for(decision.reason)
    fields = "".join(f"{name}: {value}\r\n" for name, value in deny_headers(decision, request_id).items())
    head = (
        f"HTTP/1.1 {status} {reason_phrase(decision, status, request_id)}\r\nContent-Type: application/json\r\n"
        f"{fields}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body
