"""The audit record of each approval step (operation `approval`, docs/audit.md).

`egressgate.approval.action` is `requested`, `approved`, `denied` or `expired`; approved and denied
records name who decided (`egressgate.approval.by`), approved ones the scope and the expiry instant.
Built here once, so the gateway (requested), the admin API (approved, denied) and the sweeper (expired)
write the same shape.
"""

from __future__ import annotations

from collections.abc import Mapping

from egressgate.approvals.model import Approval
from egressgate.audit.build import APPROVAL_ID, build
from egressgate.audit.event import AuditEvent, EventKind

# not_applied: the approved/denied record just before (same approval id) did not take effect (another
# decision won the race, or the store failed after the record was written)
# used: a publish grant was spent by the one publish it allowed (gateway/shared/approval_gate.py spend)
ACTIONS = ("requested", "approved", "denied", "expired", "not_applied", "used")


def approval_event(approval: Approval, action: str, labels: Mapping[str, str] | None = None) -> AuditEvent:
    assert action in ACTIONS
    extra: dict[str, object] = {
        APPROVAL_ID: approval.id,
        "egressgate.approval.action": action,
        "egressgate.approval.kind": approval.kind,
        "egressgate.approval.requested_at": approval.requested_at,
    }
    if approval.decided_by is not None:
        extra["egressgate.approval.by"] = approval.decided_by
    if approval.scope is not None:
        extra["egressgate.approval.scope"] = approval.scope
    if approval.expires_at is not None:
        extra["egressgate.approval.expires_at"] = approval.expires_at
    if approval.details is not None:  # e.g. a persistent write's changes: their hash, and how many
        import hashlib
        import json

        canonical = json.dumps(approval.details, sort_keys=True, separators=(",", ":")).encode()
        extra["egressgate.approval.details_sha256"] = hashlib.sha256(canonical).hexdigest()
        if isinstance(approval.details.get("count"), int):
            extra["egressgate.approval.details_count"] = approval.details["count"]
    decision = {"approved": "allow", "denied": "deny"}.get(action)
    return build(
        EventKind.APPROVAL,
        sandbox_id=approval.sandbox_id,
        sandbox_labels=dict(labels) if labels else None,
        decision=decision,
        policy_name=approval.policy,
        scheme=approval.scheme,
        host=approval.host,
        port=approval.port,
        method=approval.method,
        path=approval.path,
        extra=extra,
    )
