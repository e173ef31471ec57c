"""The one way an `AuditEvent` is made: every component asks `build()` for its records.

Why one builder: the rules that make records comparable across the gateway, the DNS resolver and the
admin API used to be repeated at ~15 hand-built `AuditEvent(...)` calls and drifted (a deny message on
an allow, a pinned address on a deny, a labels dict shared with live connection state). Here they are
stated once:

- every record has a time (now, unless the decision's own time is given) and a request id (a fresh one
  unless it belongs to an earlier decision, e.g. an outcome);
- a `Decision` is rendered the same way everywhere: effect, reason and rule, the credential capability
  (a name, never a value), its `detail` as one attribute, and its message only on a deny (an allow has
  nothing to tell the agent);
- the address the gateway dialed (`pinned_address`) is only recorded for an allow: a denied flow never
  dialed anything;
- mappings are copied, so a record never aliases state that keeps changing after it was queued.

Request ids live here too: they are the audit trail's join key (decision ↔ outcome ↔ deny body).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from typing import Any

from egressgate.audit.event import AuditEvent, EventKind
from egressgate.policy.facts import Decision

DETAIL = "egressgate.detail"  # the attribute a decision's detail goes to (docs/audit.md)
APPROVAL_ID = "egressgate.approval.id"

_ID_KEY = os.urandom(32)
_ID_COUNTER = itertools.count()


def _new_id_key() -> None:
    """A forked child is another process: its own key and counter, or two processes would hand out the
    same ids (the test suite's fork server, tests/support/zygote.py, forks gateways with this module loaded)."""
    global _ID_KEY, _ID_COUNTER
    _ID_KEY = os.urandom(32)
    _ID_COUNTER = itertools.count()


os.register_at_fork(after_in_child=_new_id_key)


def new_request_id() -> str:
    """128-bit ids, unique per process (a counter) and unguessable across sandboxes (keyed BLAKE2b of
    it: a sequential id in a deny body would tell one sandbox how busy the others are). About 4x cheaper
    than uuid4, which costs a getrandom syscall and a UUID object per request."""
    return hashlib.blake2b(next(_ID_COUNTER).to_bytes(8, "big"), key=_ID_KEY, digest_size=16).hexdigest()


def build(
    kind: EventKind,
    *,
    request_id: str | None = None,
    time_ns: int | None = None,
    verdict: Decision | None = None,
    detail_key: str = DETAIL,
    sandbox_labels: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
    **fields: Any,
) -> AuditEvent:
    """One audit record of `kind`.

    `verdict`: the decision this record states (fills decision, reason, rule_id, capability, message and
    the detail attribute under `detail_key`); explicit `fields` win over what the verdict implies, so a
    record may name e.g. the rule of the allow that a later stage turned into a deny. Any other
    AuditEvent field is passed by name (a misspelt one is a TypeError, not a silently empty field)."""
    attributes = dict(extra) if extra else {}
    if verdict is not None:
        derived: dict[str, Any] = {
            "decision": str(verdict.effect), "reason": str(verdict.reason), "rule_id": verdict.rule_id,
            "capability": verdict.capability, "message": None if verdict.allowed else (verdict.message or None),
        }
        derived.update(fields)
        fields = derived
        if verdict.detail and detail_key not in attributes:
            attributes[detail_key] = verdict.detail
        if verdict.approval_id:  # the approval that allowed it, or the one the deny asks an operator for
            attributes.setdefault(APPROVAL_ID, verdict.approval_id)
        if not verdict.allowed:
            fields["pinned_address"] = None
    return AuditEvent(
        kind=kind,
        time_ns=time.time_ns() if time_ns is None else time_ns,
        request_id=new_request_id() if request_id is None else request_id,
        sandbox_labels=dict(sandbox_labels) if sandbox_labels else {},
        extra=attributes,
        **fields,
    )
