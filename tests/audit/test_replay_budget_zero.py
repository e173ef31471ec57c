"""Replay of concurrent requests under a rule's request budget (issue 23, item 1: the budget world).

Several requests decided at once all read the same state: the rule had 0 uses. Their records must carry
that zero, or `audit replay` fills the rule's usage in from the log (every allowed record before it) and
flips the later ones to `budget_exceeded`, although the same policy allowed them. Found by the budget
world of tests/state_redis replaying its trail at teardown (54 false flips in test_budget_exact.py).
"""

from __future__ import annotations

import textwrap

from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.find import iter_records
from egressgate.audit.replay import replay
from egressgate.policy.decide import decide
from egressgate.policy.facts import Facts, Operation, RuleUsage, SandboxState
from egressgate.policy.loader import load_policy

POLICY = """
sandbox: {name: few}
network:
  http:
    allow:
      - {id: few, host: up.test, ports: [80], paths: [/few], budget: {requests: %d}}
      - {id: other, host: up.test, ports: [80], paths: [/other]}
"""
T0 = 1_795_000_000.0
FACTS = Facts(Operation.HTTP_REQUEST, "up.test", 80, "http", "POST", "/few")


async def record(sink, policy, states: list[SandboxState]) -> None:
    """What the gateway writes: one decision record per request, each with the state it was decided on
    reduced by the live policy (CompiledPolicy.relevant_state)."""
    for i, state in enumerate(states):
        state = policy.relevant_state(state)
        now = T0 + 1 + i / 1000
        d = decide(policy, FACTS, state, now)
        await sink.write(
            AuditEvent(
                EventKind.HTTP_REQUEST,
                int(now * 1e9),
                f"r{i}",
                sandbox_id="sbx-1",
                decision=str(d.effect),
                reason=str(d.reason),
                rule_id=d.rule_id,
                policy_name=policy.name,
                policy_hash=policy.hash,
                scheme="http",
                host="up.test",
                port=80,
                method="POST",
                path="/few",
                facts=FACTS,
                state=state,
            )
        )


def write_policy(tmp_path, budget: int):
    path = tmp_path / f"few-{budget}.yaml"
    path.write_text(textwrap.dedent(POLICY % budget))
    return path


async def test_concurrent_requests_decided_on_zero_uses_replay_unchanged(make_sink, tmp_path):
    path = write_policy(tmp_path, 3)
    policy = load_policy(path)
    sink = await make_sink()
    # five requests at once: each decided on the snapshot before any was counted
    await record(sink, policy, [SandboxState("sbx-1", T0)] * 5)
    await sink.close()
    usage = [
        f.record.attributes.get("egressgate.state.rule_usage")
        for f in iter_records([sink.path])
        if f.record.attributes.get("egressgate.operation") == "http_request"
    ]
    assert usage == [{"few": {"requests": 0, "bytes": 0}}] * 5  # the zero is recorded, not left out
    result = replay([sink.path], path)
    assert result.changes == [] and result.replayed == 5


async def test_positive_control_recorded_uses_still_flip_under_a_smaller_budget(make_sink, tmp_path):
    """The same records under a budget of 1 still allow all five (each was decided on 0 uses: replay is the
    recorded state), while sequential requests whose records carry 1, 2, ... uses flip."""
    path = write_policy(tmp_path, 3)
    policy = load_policy(path)
    sink = await make_sink()
    await record(sink, policy, [SandboxState("sbx-1", T0, rule_usage={"few": RuleUsage(n, 0)}) for n in range(3)])
    await sink.close()
    assert replay([sink.path], path).changes == []
    flips = replay([sink.path], write_policy(tmp_path, 1)).changes
    assert [c.direction for c in flips] == ["allow->deny", "allow->deny"]
    assert {c.new_reason for c in flips} == {"budget_exceeded"}


def test_relevant_state_keeps_only_budgeted_rules_and_their_zeros(tmp_path):
    policy = load_policy(write_policy(tmp_path, 3))
    state = SandboxState("sbx-1", T0, rule_usage={"other": RuleUsage(7, 70)})
    assert dict(policy.relevant_state(state).rule_usage) == {"few": RuleUsage(0, 0)}
    used = SandboxState("sbx-1", T0, rule_usage={"few": RuleUsage(2, 9)})
    assert policy.relevant_state(used) is used  # already exactly what decide() reads: no copy
