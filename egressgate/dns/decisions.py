"""`decide()` for DNS queries, with the inputs it reads and a memo where the answer cannot change.

Why a memo: for a DNS query, `policy.decide` reads the policy, the canonical name, the query type and - only
when the policy sets `network.dns.budget.queries` or `.name_bytes` - the sandbox's DNS counters (see
`policy/decide.py:_decide_dns`; nothing else of the state, and not the clock). For a policy without those
budgets the decision is therefore a pure function of (policy, name, qtype), and a sandbox asks the same few
names over and over. The memo is keyed by the policy *object* (a reload makes a new object, so a changed
policy never sees an old decision), bounded, and cleared whole when full (random exfil-shaped names only
cost a miss each). Decisions and facts are frozen dataclasses, safe to share between queries.
With count budgets every query calls `decide()` with the counters the state store returned.
"""

from __future__ import annotations

from typing import Protocol

from egressgate.policy.compile import CompiledPolicy
from egressgate.policy.decide import decide
from egressgate.policy.facts import Decision, Facts, Operation, SandboxState


class DnsInputs(Protocol):
    """What the resolver knows about the asker (dns/events.QueryContext)."""

    sandbox_id: str | None
    client: str
    labels: dict[str, str] | None
    admitted_at: float | None
    dns_counts: tuple[int, int] | None


class DnsDecisions:
    def __init__(self, max_entries: int = 8192) -> None:
        self.max_entries = max_entries
        self._memo: dict[tuple[CompiledPolicy, str, str], Decision] = {}
        self.hits = 0

    def decide(self, policy: CompiledPolicy, host: str, qtype: str, ctx: DnsInputs, now: float) -> Decision:
        dns = policy.dns
        if dns.max_queries is None and dns.max_name_bytes is None:
            key = (policy, host, qtype)
            found = self._memo.get(key)
            if found is not None:
                self.hits += 1
                return found
            decision = decide(policy, self.facts(host, qtype), self.state(ctx, now), now)
            if len(self._memo) >= self.max_entries:
                self._memo.clear()
            self._memo[key] = decision
            return decision
        return decide(policy, self.facts(host, qtype), self.state(ctx, now), now)

    @staticmethod
    def facts(host: str, qtype: str) -> Facts:
        """The facts of a DNS query; the audit record carries all of them (operation, name, scheme, qtype)."""
        return Facts(operation=Operation.DNS_QUERY, host=host, scheme="dns", qtype=qtype)

    @staticmethod
    def state(ctx: DnsInputs, now: float) -> SandboxState:
        """The sandbox state as far as a DNS decision reads it: the DNS counters before this query (the
        audit record carries them and `admitted_at`; the other fields are not DNS inputs)."""
        queries, name_bytes = ctx.dns_counts or (0, 0)
        return SandboxState(
            sandbox_id=ctx.sandbox_id or f"unknown:{ctx.client}",
            admitted_at=ctx.admitted_at if ctx.admitted_at is not None else now,
            labels=ctx.labels or {},
            dns_queries=queries,
            dns_name_bytes=name_bytes,
        )
