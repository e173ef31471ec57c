"""What a tool-call decision reads from the stores, and how the mediator records it (mcp/mediator.py).

Kept apart from the session so each module stays one concern: here the reads (`read_facts`: from the
gateway flow carrying the body when it already read them, else from the stores) and the pure helpers —
which reads a tool needs (network state only for `allowed_by_network` arguments, grants only for
`approval: required` tools), what the gateway flow carrying a body already read (FromFlow), how a stored
pin is read back (a corrupt one is a store failure, never "not seen yet"), the facts as recorded for
`audit replay`, and the deny of a budget a concurrent call spent first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from egressgate.mcp.pending import HeldOutcome
from egressgate.policy.mcp_decide import McpFacts, ToolDecision
from egressgate.policy.messages import mcp_message
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

if TYPE_CHECKING:
    from egressgate.audit.event import AuditEvent
    from egressgate.mcp.mediator import McpSession
    from egressgate.policy.compile import CompiledPolicy
    from egressgate.policy.facts import SandboxState


@dataclass(slots=True)
class FromFlow:
    """What the gateway flow carrying a client body already knows (gateway/mcp/route.py), so a call is
    decided and recorded without reading it again: the flow's network decision record (owed: record.py
    deferred it), folded into the first recorded tools/call's `mcp_tool_call` record (one record per
    call; docs/audit.md "MCP"); and the facts its network decision read moments ago for this very POST —
    the sandbox's labels (its identity was resolved and found not revoked) and the state snapshot
    (`allowed_by_network` arguments are decided on it, as the POST itself was)."""

    record: AuditEvent | None  # None: not folded (the POST's record was already written)
    labels: Mapping[str, str]
    snapshot: SandboxState | None
    policy_hash: str | None = None  # of the policy the flow was decided under: its snapshot is that policy's
    used: bool = False  # the record was folded into a durable mcp_tool_call record
    held: HeldOutcome | None = None  # the folded call was forwarded: its outcome, for the flow's outcome


class Refused(Exception):
    def __init__(self, reason: Reason) -> None:
        self.reason = reason


def needs_network(policy: CompiledPolicy, server: str, tool: str) -> bool:
    compiled = policy.mcp.servers.get(server)
    entry = compiled.allowed.get(tool) if compiled is not None else None
    return entry is not None and any(a.allowed_by_network for a in entry.arguments.values())


def needs_approval(policy: CompiledPolicy, server: str, tool: str) -> bool:
    compiled = policy.mcp.servers.get(server)
    entry = compiled.allowed.get(tool) if compiled is not None else None
    return entry is not None and entry.approval_required


def read_info(raw: str | None) -> tuple[str, str] | None:
    if raw is None:
        return None
    try:
        name, version = json.loads(raw)
    except (ValueError, TypeError):
        raise Refused(Reason.STATE_UNAVAILABLE) from None  # a corrupt pin is never "not seen yet"
    return str(name), str(version)


def facts_record(facts: McpFacts) -> dict[str, Any]:
    """What the decision read, for `audit replay` (docs/audit.md, MCP)."""
    out: dict[str, Any] = {"server_calls": facts.server_calls, "tool_calls": facts.tool_calls}
    for key in ("server_info_seen", "server_info_now"):
        value = getattr(facts, key)
        if value is not None:
            out[key] = list(value)
    for key in ("tool_schema_seen", "tool_schema_now"):
        value = getattr(facts, key)
        if value is not None:
            out[key] = value
    if facts.grants:
        out["grants"] = [{k: v for k, v in g.to_json().items() if v is not None} for g in facts.grants]
    return out


def budget_deny(policy: CompiledPolicy, server: str, tool: str, allowed: ToolDecision, key: str) -> ToolDecision:
    message = mcp_message(policy, Reason.BUDGET_EXCEEDED, server, tool, rule_id=allowed.rule_id, detail=key)
    return ToolDecision("deny", Reason.BUDGET_EXCEEDED, allowed.rule_id, message, detail=key)


async def read_facts(
    session: McpSession, policy: CompiledPolicy, tool: str, now: float, flow: FromFlow | None = None
) -> McpFacts:
    """The facts `decide_tool_call` reads for one call of `tool` in `session`: the sandbox's labels
    and, for `allowed_by_network` arguments, its state snapshot (from `flow` when it read them for this
    very POST under the same policy, else from the store), the call counts and pins (one store read),
    and grants only for a tool that needs approval. Raises Refused (revoked, store unavailable)."""
    state = session.rt.state
    server_key, tool_key = f"mcp:{session.server_name}", f"mcp:{session.server_name}/{tool}"
    try:
        if flow is not None:  # the flow's identity stage read the record for this very POST
            labels = flow.labels
        else:
            record = await state.get(session.sandbox_id)
            if record is None or record.revoked:
                raise Refused(Reason.SANDBOX_REVOKED)
            labels = record.labels
        if session.server_side.pin_failed:
            raise Refused(Reason.STATE_UNAVAILABLE)
        snap = None
        if needs_network(policy, session.server_name, tool):  # allowed_by_network: decided like a request
            # the flow's snapshot holds what ITS policy reads (relevant_state): not after a reload
            snap = flow.snapshot if flow is not None and flow.policy_hash == session.ctx.policy_hash else None
            if snap is None:
                snap = await state.snapshot(
                    session.sandbox_id, history=policy.history_patterns, rules=policy.budgeted_rules
                )
        counts, pins = await state.mcp_read(session.sandbox_id, session.server_name, [server_key, tool_key])
        session.server_side.known = dict(pins)
        # grants matter only to a tool that needs approval: no store read for the others
        grants: tuple = ()
        if needs_approval(policy, session.server_name, tool):
            grants = await session.rt.approvals.grants(session.sandbox_id, now)
    except KeyError:
        raise Refused(Reason.SANDBOX_REVOKED) from None
    except StateUnavailable:
        raise Refused(Reason.STATE_UNAVAILABLE) from None
    return McpFacts(
        sandbox_id=session.sandbox_id,
        labels=MappingProxyType(dict(labels)),  # current (readmission)
        server_calls=counts.get(server_key, 0),
        tool_calls=counts.get(tool_key, 0),
        server_info_seen=read_info(pins.get("server_info")),
        tool_schema_seen=pins.get("tool:" + tool),
        tool_schema_now=session.server_side.tool_hashes.get(tool),
        server_info_now=session.server_side.server_info_now,
        grants=grants,
        network_state=snap,
    )
