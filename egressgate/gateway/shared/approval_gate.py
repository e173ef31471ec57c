"""Where the gateway meets approvals: live grants into decide(), pending approvals out of it.

decide() is pure: it gets the sandbox's live grants in its `SandboxState` (read only when they can
matter: a request the rules refused, under a policy that requires approval for network_expansion, or a
request of an operation class -- package install, publish -- whose policy lets it through only with an
approval) and answers `approval_required` for a request an operator could approve. Here that
deny gets its approval: the pending one for the same sandbox and target (retries share one id), a new
one (audited `requested`), or none when the sandbox already has too many waiting. The request itself is
refused at once: nothing is held open while an operator decides; the agent retries.

The approval records written here (`requested`, `used`) name the sandbox by the identity facts the
decision itself read: the id and labels of its `SandboxState` (the registry's, as the admin API's
`approved` / `denied` records do). They are taken from the state, not from a caller's argument, so the
explicit proxy, the transparent listener and a tunnel cannot record an approval differently.
"""

from __future__ import annotations

from dataclasses import replace

from egressgate.approvals.audit import approval_event
from egressgate.approvals.model import (
    KIND_NETWORK_EXPANSION,
    KIND_PACKAGE_INSTALL,
    KIND_PUBLISH,
    MAX_PENDING_PER_SANDBOX,
    Approval,
    ApprovalState,
    new_approval_id,
)
from egressgate.approvals.overlay import NETWORK_EXPANSION
from egressgate.gateway.shared.context import Runtime
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.gateway.shared.emit import write_behind
from egressgate.policy.compile import CompiledPolicy
from egressgate.policy.decide import decide
from egressgate.policy.facts import Decision, Facts, Operation, SandboxState
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable


async def settle(
    rt: Runtime,
    policy: CompiledPolicy,
    policy_name: str,
    facts: Facts,
    state: SandboxState,
    decision: Decision,
    now: float,
) -> tuple[Decision, SandboxState]:
    """Called only for an `approval_required` decision (callers test the reason: nothing else pays an
    await). Returns (decision, the state it was made on).

    Grants are read only now, when the decision without them is `approval_required` (the overlay is the
    engine's last step, so they cannot change any other answer): a rule-allowed request costs no store
    lookup and keeps working while the approval store is down. A store failure here is
    `state_unavailable`, never an allow. A live grant that covers the request turns it into
    `approval_granted`; otherwise the deny gets its approval (name_approval)."""
    assert decision.reason is Reason.APPROVAL_REQUIRED and (
        NETWORK_EXPANSION in policy.approval_kinds or decision.approval_kind is not None
    )
    try:
        grants = await rt.approvals.grants(state.sandbox_id, now)
    except StateUnavailable:
        return gateway_deny(Reason.STATE_UNAVAILABLE), state
    if grants:
        state = replace(state, approvals=grants)
        decision = decide(policy, facts, state, now)
    return await name_approval(rt, state, policy_name, facts, decision, now), state


async def spend(
    rt: Runtime,
    policy: CompiledPolicy,
    policy_name: str,
    facts: Facts,
    state: SandboxState,
    decision: Decision,
    now: float,
) -> Decision:
    """A `publish` approval lets ONE publish through: the request that commits it (policy/opclass.py
    publish_commit) uses the grant up, atomically in the store, before anything goes upstream. A request
    that finds it already used (a concurrent one won) is decided again without it; a store failure is
    `state_unavailable`, never an allow."""
    assert decision.approval_id is not None
    try:
        used = await rt.approvals.consume(state.sandbox_id, decision.approval_id, now)
    except StateUnavailable:
        return gateway_deny(Reason.STATE_UNAVAILABLE)
    if used is None:
        rest = replace(state, approvals=tuple(g for g in state.approvals if g.id != decision.approval_id))
        again = decide(policy, facts, rest, now)
        if again.reason is Reason.APPROVAL_GRANTED and again.approval_kind == KIND_PUBLISH:
            return await spend(rt, policy, policy_name, facts, rest, again, now)
        return await name_approval(rt, state, policy_name, facts, again, now)
    write_behind(rt, approval_event(used, "used", state.labels))
    return decision


def _target(facts: Facts) -> str:
    if facts.operation is Operation.CONNECT:
        return f"{facts.host}:{facts.port}"
    return f"{facts.method} {facts.scheme}://{facts.host}:{facts.port}{facts.path or '/'}"


async def name_approval(
    rt: Runtime, state: SandboxState, policy_name: str, facts: Facts, decision: Decision, now: float
) -> Decision:
    """An `approval_required` deny with its approval id and the one sentence the agent acts on; the
    approval is `state`'s sandbox's, and its `requested` record carries that state's labels."""
    if decision.reason is not Reason.APPROVAL_REQUIRED or decision.approval_id is not None:
        return decision
    assert facts.port is not None
    http = facts.operation is Operation.HTTP_REQUEST
    kind = decision.approval_kind or KIND_NETWORK_EXPANSION
    draft = Approval(
        id=new_approval_id(),
        sandbox_id=state.sandbox_id,
        policy=policy_name,
        state=ApprovalState.PENDING,
        scheme=facts.scheme if http else None,
        host=facts.host,
        port=facts.port,
        method=facts.method if http else None,
        path=facts.path if http else None,
        requested_at=now,
        kind=kind,
    )
    try:
        approval, created = await rt.approvals.request(draft, now)
    except StateUnavailable:
        return replace(
            decision,
            approval_id=None,
            message=(
                f"{_target(facts)} needs an operator's approval, but the approval store is unavailable; retry later."
            ),
        )
    target = _target(facts)
    if approval is None:
        return replace(
            decision,
            detail="too_many_pending",
            message=(
                f"{target} needs an operator's approval, but {MAX_PENDING_PER_SANDBOX} approvals of this sandbox "
                "are already waiting; retry after an operator decides them."
            ),
        )
    if created:
        write_behind(rt, approval_event(approval, "requested", state.labels))  # queued, never dropped
    if approval.state is ApprovalState.DENIED:
        return replace(
            decision,
            approval_id=approval.id,
            message=(
                f"An operator denied approval {approval.id} for {target}; do not retry it or route around the gateway."
            ),
        )
    if kind != KIND_NETWORK_EXPANSION:
        what = "a package install" if kind == KIND_PACKAGE_INSTALL else "a publish"
        return replace(
            decision,
            approval_id=approval.id,
            message=(
                f"{target} is {what} ({facts.op_protocol or '?'}), which policy {policy_name!r} lets through only "
                f"with an operator's approval; it waits for approval {approval.id} (kind {kind}): retry this request "
                f"after an operator approves it (egressgate approvals approve {approval.id})."
            ),
        )
    return replace(
        decision,
        approval_id=approval.id,
        message=(
            f"{target} is outside this sandbox's allowlist and waits for operator approval {approval.id}; retry "
            f"this request after an operator approves it (egressgate approvals approve {approval.id})."
        ),
    )
