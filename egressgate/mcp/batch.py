"""Batches are forwarded whole or not at all (issue 23, item 10): the one rule for a batch whose calls were
decided differently. Forwarding the allowed half as a new, smaller batch would run calls the agent asked for
together with one that was refused — whatever the agent meant by sending them together no longer holds."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from egressgate.mcp.jsonrpc import Message, deny_error
from egressgate.mcp.pending import Ticket, id_key
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

if TYPE_CHECKING:
    from egressgate.mcp.mediator import McpSession


async def withdraw(
    session: McpSession, messages: list[Message], forward: list[dict], denial: dict, ticket: Ticket | None
) -> list[dict]:
    """A batch is forwarded whole or not at all: when one of its calls was refused, its allowed calls
    are not forwarded as a smaller batch (the agent asked for them together). Each allowed call keeps
    its `allow` record and gets a `no_response` outcome (detail `batch_refused`), its counted budget
    back, and a JSON-RPC error; other requests of the batch get the same error (their ids are freed)."""
    data = denial.get("error", {}).get("data", {})
    reason, rule = str(data.get("reason", Reason.MCP_TOOL_DENIED)), data.get("rule")
    message = (
        f"Not forwarded: another message of the same batch was refused ({reason}); a batch is "
        "forwarded whole or not at all. Send each tools/call in its own message."
    )
    sent = {id(obj) for obj in forward}
    replies = []
    for msg in messages:
        if id(msg.obj) not in sent or msg.kind != "request":
            continue
        if msg.is_call:
            pending = session.calls.pop(msg.id, None)  # type: ignore[arg-type]
            if pending is not None:
                if pending.counted:
                    with contextlib.suppress(StateUnavailable):
                        await session.rt.state.refund_calls(session.sandbox_id, pending.counted)
                session._no_response(msg.id, pending, "batch_refused")  # type: ignore[arg-type]
        else:
            session.outstanding.pop(id_key(msg.id), None)
            session.server_side.expected.pop(msg.id, None)  # type: ignore[arg-type]
        replies.append(deny_error(msg.id, message, reason, rule))
    if ticket is not None:
        ticket.calls.clear()
        ticket.others.clear()
    return replies
