"""A relayed tunnel is a request to its host: it enters the sandbox's request history.

`when: {after_request_to: ..., unless_request_to: ...}` conditions and per-rule request budgets read the
sandbox's history (`state.record_request`), which the HTTP path writes for every allowed request
(enforce.py). A tunnel the gateway relays without reading it (`tls: passthrough`, a `network.tcp` rule)
carries requests nobody sees, so the tunnel itself is the request: it is written before the first byte
goes upstream. Without it, a sandbox could read `secrets.example.com` through a passthrough tunnel and
still pass `unless_request_to: [secrets.example.com]` on its way to an upload host.

Fail closed: a history that cannot be written refuses the tunnel (`state_unavailable`), since every
later condition would be judged on a history that misses this contact. The refusal is audited: its
decision record (an allow) was durable before the history was written, so `refuse_unrecorded` adds the
tunnel's outcome record, under the same request id (the one the client's deny body carries), with decision
`deny` and the reason, awaited before the client reads the refusal (`write_after`: queued and retried if
the sink fails, never dropped). A passthrough tunnel's refusal is the outcome record passthrough.py
writes anyway, so it calls `record_contact` alone.
"""

from __future__ import annotations

import logging

from egressgate.audit.build import build
from egressgate.audit.event import EventKind
from egressgate.gateway.shared.context import ConnState, Runtime
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.emit import conn_attributes, write_after
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)


async def record_contact(rt: Runtime, sandbox_id: str | None, host: str | None,
                         rule_id: str | None) -> Decision | None:
    """Write the tunnel's host (and its rule's use) into the sandbox's history; the deny if it failed.
    The rule's `budget.requests` (tunnels) is checked and counted in the same atomic store step: decide()
    saw a snapshot that concurrent tunnels (here or on another gateway process) may have shared."""
    if sandbox_id is None or host is None:
        return gateway_deny(Reason.STATE_UNAVAILABLE)
    requests_max = _requests_max(rt, sandbox_id, rule_id)
    try:
        if not await rt.state.record_request(sandbox_id, host, rule_id, 0, requests_max=requests_max):
            return gateway_deny(Reason.BUDGET_EXCEEDED, f"The budget of rule {rule_id!r} is spent (its "
                                "budget.requests); further tunnels under it are refused.",
                                detail="rule_budget", rule_id=rule_id)
    except (StateUnavailable, KeyError):
        logger.error("could not record the tunnel to %s in the history of %s", host, sandbox_id)
        return gateway_deny(Reason.STATE_UNAVAILABLE)
    return None


def _requests_max(rt: Runtime, sandbox_id: str, rule_id: str | None) -> int | None:
    """`budget.requests` of the rule that allowed a tunnel (its policy: the one its connection is bound to)."""
    if rule_id is None:
        return None
    for client_id in rt.by_sandbox.get(sandbox_id, ()):
        conn = rt.conns.get(client_id)
        policy = rt.policies.get(conn.policy_name) if conn is not None else None
        if policy is not None and rule_id in policy.budgeted_rules:
            budget = next((r.budget for r in policy.rules if r.id == rule_id), None)
            return budget.requests if budget is not None else None
        if policy is not None:
            return None
    return None


async def refuse_unrecorded(rt: Runtime, conn: ConnState, host: str | None, port: int | None,
                            rule_id: str | None, request_id: str, scheme: str) -> Decision | None:
    """`record_contact` for a raw-TCP relay: the deny if the history could not be written, with its
    outcome record written (module doc)."""
    refusal = await record_contact(rt, conn.sandbox_id, host, rule_id)
    if refusal is None:
        return None
    policy = rt.policies.get(conn.policy_name)
    await write_after(rt, build(
        EventKind.OUTCOME, request_id=request_id, verdict=refusal, rule_id=rule_id, sandbox_id=conn.sandbox_id,
        policy_name=conn.policy_name, policy_hash=policy.hash if policy is not None else None, scheme=scheme,
        host=host, port=port, bytes_out=0, bytes_in=0, extra=conn_attributes(conn),
    ))
    return refusal
