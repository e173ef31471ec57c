"""The decision event every component hands to the audit sink.

One `AuditEvent` per decision (CONNECT, HTTP request, DNS query, credential issue, budget event,
admission/revocation, policy reload) and one `outcome` event linked to it by `request_id` once the
effect is known. The sink turns it into an OTLP log record; components never format records themselves,
so the escaping and hashing rules live in one place (audit/record.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from egressgate.policy.facts import Facts, SandboxState


class EventKind(StrEnum):
    CONNECT = "connect"
    HTTP_REQUEST = "http_request"
    DNS_QUERY = "dns_query"
    OUTCOME = "outcome"  # status / bytes / duration of an earlier allowed decision (same request_id)
    CREDENTIAL_ISSUE = "credential_issue"
    BUDGET = "budget"
    # a dead worker's outstanding byte lease, forfeited (gateway/service/reconcile.py)
    BUDGET_RECONCILE = "budget_reconcile"
    ADMISSION = "admission"
    REVOCATION = "revocation"
    POLICY_RELOAD = "policy_reload"
    APPROVAL = "approval"  # an approval requested, approved, denied or expired (egressgate/approvals)
    # a client connection refused or closed by a limit/timeout (gateway/pipeline/connguard.py)
    CONNECTION = "connection"
    # MCP (egressgate/mcp/records.py): one decision per tools/call (its effect is an OUTCOME record with
    # the same request_id), a tools/list answer that changed a tool's hash, and other MCP messages the
    # gateway refused or recorded (malformed, a serverInfo that differs from its pin)
    MCP_TOOL_CALL = "mcp_tool_call"
    MCP_TOOLS_LIST = "mcp_tools_list"
    MCP_MESSAGE = "mcp_message"
    # a persistent workspace saved, restored (or refused), changed outside a run and accepted, removed, or a
    # staged write applied or discarded (runtimes/persist.py, admin/workspaces_api.py)
    WORKSPACE = "workspace"


@dataclass(slots=True)
class AuditEvent:
    kind: EventKind
    time_ns: int  # wall clock of the decision, unix nanoseconds
    request_id: str  # unique per decision; the outcome event reuses its decision's id
    sandbox_id: str | None = None
    sandbox_labels: dict[str, str] = field(default_factory=dict)
    decision: str | None = None  # "allow" | "deny"
    reason: str | None = None  # policy.reasons.Reason value
    rule_id: str | None = None
    policy_name: str | None = None
    policy_hash: str | None = None
    # target, as sent by the sandbox and in canonical form
    target_as_sent: str | None = None
    scheme: str | None = None
    host: str | None = None  # canonical
    port: int | None = None
    method: str | None = None
    path: str | None = None  # canonical, no query
    query: str | None = None  # raw query string as sent (for the request hash), never with injected creds
    qtype: str | None = None  # DNS
    answers: list[str] | None = None  # DNS answers returned
    pinned_address: str | None = None
    client_address: str | None = None
    status: int | None = None
    bytes_out: int | None = None
    bytes_in: int | None = None
    duration_ms: float | None = None
    capability: str | None = None  # credential capability name; never a value
    key_id: str | None = None
    request_hash: str | None = None
    body_hash: str | None = None
    message: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other egressgate.* attributes (str/int/float/bool)
    # The exact inputs given to decide(), recorded so `audit replay` re-decides with the same facts and
    # sandbox state (prior bytes, DNS counts, seen hosts, rule usage, admitted_at). Optional: without
    # them replay falls back to the target fields above and to state reconstructed from the log.
    facts: Facts | None = None
    state: SandboxState | None = None


class AuditUnavailable(RuntimeError):
    """The sink could not make a record durable; the caller must deny (reason audit_unavailable)."""
