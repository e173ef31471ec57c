"""Counters for the DNS resolver.

Plain integers on one object (single event loop, so `+=` is atomic): cheap enough for the hot path and easy
for the admin API to expose. Every input we refuse to process (garbage, oversize, overload) is counted here
rather than logged, because a flood of garbage must not turn into a flood of log lines.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class DnsMetrics:
    queries: int = 0  # well-formed queries that reached a decision
    allowed: int = 0
    denied: int = 0  # policy denials (name, qtype, address, identity), not counting budget/rate
    budget_exceeded: int = 0
    rate_limited: int = 0
    answers_stripped: int = 0  # records removed by the answer filter
    emptied_answers: int = 0  # allowed answers left without addresses -> deny rcode
    cache_hits: int = 0
    cache_misses: int = 0
    upstream_queries: int = 0
    upstream_timeouts: int = 0
    upstream_mismatches: int = 0  # replies with a wrong id, source or question (ignored)
    upstream_tcp_retries: int = 0
    upstream_errors: int = 0  # SERVFAIL/REFUSED/unparseable from upstream
    servfail: int = 0  # SERVFAIL answers we sent
    formerr: int = 0
    notimp: int = 0
    dropped_malformed: int = 0  # not even a header: nothing to answer
    dropped_oversize: int = 0
    dropped_responses: int = 0  # QR bit set: never answer a response (reflection loops)
    dropped_overload: int = 0
    udp_send_failed: int = 0
    truncated: int = 0  # UDP answers sent with TC
    audit_failures: int = 0
    state_failures: int = 0
    internal_errors: int = 0  # bugs caught at the top level; answered SERVFAIL
    tcp_connections: int = 0
    tcp_rejected: int = 0  # over the connection cap
    tcp_idle_closed: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
