"""Credential misuse: a placeholder credential (phantom) where it may not be. Credentials finds it in
headers, buffered bodies and websocket messages; in a streamed body compose.py's phantom guard finds it,
and the callable Enforce builds calls `stream_misuse`. Shared by those two stages.
"""

from __future__ import annotations

import logging

from mitmproxy import http

from egressgate.audit.build import build
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.broker.inject import PhantomHit
from egressgate.gateway.shared.context import FlowState, Runtime
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.emit import write_behind
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)

MISUSE_MESSAGE = (
    "A placeholder credential (egph_...) may only be sent in the header configured for its own "
    "destination; remove it from this request."
)

def misuse_event(fs: FlowState, where: str) -> AuditEvent:
    return build(
        EventKind.HTTP_REQUEST, request_id=fs.request_id,
        sandbox_id=fs.sandbox_id, decision="deny", reason=str(Reason.CREDENTIAL_MISUSE),
        rule_id=fs.decision.rule_id if fs.decision else None, policy_name=fs.policy_name,
        policy_hash=fs.policy_hash, scheme=fs.scheme, host=fs.host, port=fs.port, method=fs.method,
        path=fs.path, capability=fs.decision.capability if fs.decision else None,
        message=MISUSE_MESSAGE, extra={"egressgate.detail": where, "egressgate.phase": "after_headers"},
    )


def stream_misuse(rt: Runtime, flow: http.HTTPFlow, fs: FlowState, hits: list[PhantomHit], where: str = "body",
                  *, cut: bool = True) -> None:
    """A phantom in a streamed body (compose.py's guard calls this): nothing more is forwarded, the
    connection is cut (the upstream never sees a complete body; `cut=False` when the caller closes it
    another way) and the deny is audited."""
    logger.warning("phantom credential misuse by %s to %s (streamed %s)", fs.sandbox_id, fs.host, where)
    event = misuse_event(fs, where)
    fs.decision = gateway_deny(Reason.CREDENTIAL_MISUSE, MISUSE_MESSAGE, detail=where,
                               rule_id=fs.decision.rule_id if fs.decision else None)
    write_behind(rt, event)  # already refused: its record cannot be denied (emit.write_behind)
    if cut and rt.abort_connection is not None:
        rt.abort_connection(flow.client_conn.id)
