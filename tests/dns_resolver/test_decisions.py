"""The DNS decision memo gives exactly what decide() gives, and never outlives its policy object."""

from __future__ import annotations

from egressgate.dns.decisions import DnsDecisions
from egressgate.dns.events import QueryContext
from egressgate.dns.wire import parse_query
from egressgate.policy.decide import decide
from egressgate.policy.facts import Facts, Operation, SandboxState
from egressgate.policy.loader import parse_policy
from tests.support.dnsclients import POLICIES

NAMES = [
    "allowed.example.com",
    "x.wild.example.com",
    "evil.example.org",
    "metadata.google.internal",
    "api.example.net",
    "a.budget.example.com",
]
QTYPES = ["A", "AAAA", "TXT", "HTTPS", "MX"]


def _ctx(counts: tuple[int, int]) -> QueryContext:
    query = parse_query(b"\x00\x01\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x01a\x00\x00\x01\x00\x01", 512)
    ctx = QueryContext(query, "127.0.0.2", "udp", 0.0, sandbox_id="sbx-1", labels={"team": "x"})
    ctx.admitted_at, ctx.dns_counts = 1_795_000_000.0, counts
    return ctx


def test_memo_agrees_with_decide_for_every_state():
    decisions = DnsDecisions()
    for name in ("dns-test", "dns-refused", "dns-budget"):
        policy = parse_policy(POLICIES[name], f"<{name}>")
        for counts in [(0, 0), (2, 150), (3, 0), (0, 199), (1000, 10**6)]:
            for host in NAMES:
                for qtype in QTYPES:
                    ctx = _ctx(counts)
                    got = decisions.decide(policy, host, qtype, ctx, 1_795_000_100.0)
                    # the full state decide() could be given: other fields must not matter to a DNS decision
                    full = SandboxState(
                        "sbx-1",
                        1_795_000_000.0,
                        {"team": "x"},
                        bytes_out=10**9,
                        bytes_in=5,
                        dns_queries=counts[0],
                        dns_name_bytes=counts[1],
                        seen_hosts=frozenset({"api.example.net"}),
                    )
                    facts = Facts(operation=Operation.DNS_QUERY, host=host, scheme="dns", qtype=qtype)
                    assert got == decide(policy, facts, full, 1_795_000_100.0), (name, counts, host, qtype)
    assert decisions.hits > 0  # the no-budget policies were served from the memo


def test_memo_is_per_policy_object_and_bounded():
    decisions = DnsDecisions(max_entries=4)
    old = parse_policy(POLICIES["dns-test"], "<old>")
    assert decisions.decide(old, "evil.example.org", "A", _ctx((0, 0)), 0.0).allowed is False
    reloaded = parse_policy(POLICIES["dns-test"].replace("allowed.example.com", "evil.example.org"), "<new>")
    assert decisions.decide(reloaded, "evil.example.org", "A", _ctx((0, 0)), 0.0).allowed is True
    for i in range(20):
        decisions.decide(old, f"n{i}.example.org", "A", _ctx((0, 0)), 0.0)
    assert len(decisions._memo) <= 4
