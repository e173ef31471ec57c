"""`decide_flow()`: the one snapshot + decide() sequence of the gateway's network decisions.

Every flow's decision is the same steps: read the sandbox's state (only what the policy can read), call the
pure `decide()` with the clock's `now`, and, for an `approval_required` answer, settle it against the
sandbox's live approvals (approval_gate.py); a granted publish approval is spent by the request that
commits the publish. The explicit proxy (pipeline/decision.py: CONNECT and every request), the
transparent listener (shared/transparent_decide.py: a connection's name, raw TCP to its original address)
and raw TCP inside a CONNECT tunnel (layers/next_layer.py) all call this, so the inputs a decision saw — and
its audit record carries for `audit replay` — are made one way.

One later check is not made here, on purpose: a rule's `budget.requests` / `budget.bytes` is checked
again by the state store's atomic check-and-count when the allowed request's bytes are reserved and it
enters the history (pipeline/budgets.py, `StateStore.reserve_request`; pipeline/enforce.py for a request
Budgets did not write). decide() judges it on a snapshot that concurrent requests share; the store's count
is the authority. A refusal there becomes the request's decision record, before anything goes upstream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from egressgate.gateway.shared.approval_gate import settle, spend
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.policy.decide import decide
from egressgate.policy.facts import Decision, Facts, SandboxState
from egressgate.policy.opclass import PUBLISH, publish_commit
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

if TYPE_CHECKING:
    from egressgate.gateway.shared.context import Runtime
    from egressgate.policy.compile import CompiledPolicy


async def snapshot(rt: Runtime, policy: CompiledPolicy, sandbox_id: str) -> SandboxState | None:
    """Only what `policy` can read (its history patterns, its budgeted rules: a Redis backend then skips
    the rest of a long history), with the byte leases this process holds counted as unspent; None when
    the store cannot answer (the caller denies `state_unavailable`: fail closed)."""
    try:
        return rt.ledger.spent_view(
            await rt.state.snapshot(sandbox_id, history=policy.history_patterns, rules=policy.budgeted_rules)
        )
    except (StateUnavailable, KeyError):
        return None


async def decide_flow(
    rt: Runtime,
    policy: CompiledPolicy,
    policy_name: str,
    sandbox_id: str,
    facts: Facts,
    *,
    approvals: bool = True,
) -> tuple[Decision, SandboxState | None]:
    """The decision for `facts`, and exactly the state it was made on (None: the store could not answer,
    and the decision is `state_unavailable`). `relevant_state` reduces any backend's snapshot to what the
    policy reads, so the decision and its record are the same as with the full snapshot. `approvals`:
    settle an `approval_required` answer (raw TCP does not: only a `tcp` rule allows it). An approval's
    records name the sandbox by the state's id and labels (approval_gate.py), whichever path asked."""
    state = await snapshot(rt, policy, sandbox_id)
    if state is None:
        return gateway_deny(Reason.STATE_UNAVAILABLE), None
    state = policy.relevant_state(state)
    now = rt.clock()
    decision = decide(policy, facts, state, now)
    if approvals and decision.reason is Reason.APPROVAL_REQUIRED:
        decision, state = await settle(rt, policy, policy_name, facts, state, decision, now)
    if (
        decision.reason is Reason.APPROVAL_GRANTED
        and decision.approval_kind == PUBLISH
        and publish_commit(facts.method, facts.op_protocol, facts.path)
    ):
        decision = await spend(rt, policy, policy_name, facts, state, decision, now)  # one publish per grant
    return decision, state
