"""`approval: required` tools: the deny of an unapproved call gets its approval (egressgate/approvals).

Same flow as network expansion (gateway/shared/approval_gate.py): the call is refused at once, never held
open; the pending approval for the same sandbox, server and tool is named again on every retry (one
id shared by retries: Approval.target_key), a new one is audited `requested`, and none is created once
the sandbox already has MAX_PENDING_PER_SANDBOX waiting. An operator approves it with the existing
commands/API; the grant (scheme "mcp", host = server, port 0, path = tool) lets the next call through
(policy/mcp_decide.py) and never widens the network allowlist (approvals/overlay.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from egressgate.approvals.audit import approval_event
from egressgate.approvals.grant import MCP_SCHEME
from egressgate.approvals.model import (
    KIND_MCP_TOOL,
    MAX_PENDING_PER_SANDBOX,
    Approval,
    ApprovalState,
    new_approval_id,
)
from egressgate.policy.mcp_decide import ToolDecision
from egressgate.state.base import StateUnavailable

if TYPE_CHECKING:
    from egressgate.mcp.mediator import McpSession
    from egressgate.policy.compile import CompiledPolicy

MCP_GRANT_PORT = 0
MCP_GRANT_METHOD = "tools/call"


async def name_tool_approval(session: McpSession, policy: CompiledPolicy, tool: str, decision: ToolDecision,
                             now: float) -> tuple[ToolDecision, str | None]:
    """(the deny with its one actionable sentence, the approval id or None)."""
    what = f"Tool {tool!r} of MCP server {session.server_name!r}"
    draft = Approval(id=new_approval_id(), sandbox_id=session.sandbox_id, policy=policy.name,
                     state=ApprovalState.PENDING, scheme=MCP_SCHEME, host=session.server_name,
                     port=MCP_GRANT_PORT, method=MCP_GRANT_METHOD, path=tool, requested_at=now, kind=KIND_MCP_TOOL)
    try:
        approval, created = await session.rt.approvals.request(draft, now)
    except StateUnavailable:
        return replace(decision, detail="approval_store_unavailable", message=(
            f"{what} needs an operator's approval, but the approval store is unavailable; retry later.")), None
    if approval is None:
        return replace(decision, detail="too_many_pending", message=(
            f"{what} needs an operator's approval, but {MAX_PENDING_PER_SANDBOX} approvals of this sandbox are "
            "already waiting; retry after an operator decides them.")), None
    if created:
        session.rt.audit.enqueue_after(approval_event(approval, "requested", dict(session.labels)))
    if approval.state is ApprovalState.DENIED:
        return replace(decision, message=(
            f"An operator denied approval {approval.id} for {what}; do not retry it.")), approval.id
    return replace(decision, message=(
        f"{what} waits for operator approval {approval.id}; retry this call after an operator approves it "
        f"(egressgate approvals approve {approval.id}).")), approval.id
