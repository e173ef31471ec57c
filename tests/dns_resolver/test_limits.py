"""Exfiltration limits: per-sandbox query count, name bytes and rate; over budget -> REFUSED + audit."""

from __future__ import annotations

import asyncio

from tests.support.dnsclients import BUDGET_IP, RATE_IP, SANDBOX_IP, addresses, ask, rcode


async def test_query_budget_exhaustion(server, upstream, audit, state):
    for name in ("a", "b", "c"):
        assert rcode(await ask(server, f"{name}.budget.example.com", source=BUDGET_IP)) == "NOERROR"
    response = await ask(server, "d.budget.example.com", source=BUDGET_IP)
    assert rcode(response) == "REFUSED"
    assert upstream.names() == ["a.budget.example.com", "b.budget.example.com", "c.budget.example.com"]
    event = audit.events[-1]
    assert (event.sandbox_id, event.decision, event.reason) == ("sbx-budget", "deny", "budget_exceeded")
    assert event.extra["egressgate.decision.detail"] == "dns.budget.queries"
    snapshot = await state.snapshot("sbx-budget")
    assert snapshot.dns_queries == 4  # every audited query counts, the refused one too
    assert snapshot.dns_name_bytes == 4 * len("a.budget.example.com")
    # other sandboxes are unaffected
    assert addresses(await ask(server, "allowed.example.com", source=SANDBOX_IP)) == ["93.184.216.34"]


async def test_concurrent_queries_cannot_overrun_budget(server, upstream):
    names = [f"n{i}.budget.example.com" for i in range(10)]
    results = await asyncio.gather(*(ask(server, name, source=BUDGET_IP) for name in names))
    codes = [rcode(r) for r in results]
    assert codes.count("REFUSED") == 7  # 3 allowed (NXDOMAIN from upstream: names not in the zone)
    assert len(upstream.seen) == 3


async def test_name_bytes_budget(server, upstream, audit, state):
    exfil = ".".join(["q" * 63, "r" * 63, "s" * 63]) + ".budget.example.com"  # 210 bytes > 200
    response = await ask(server, exfil, source=BUDGET_IP)
    assert rcode(response) == "REFUSED"
    assert audit.events[-1].extra["egressgate.decision.detail"] == "dns.budget.name_bytes"
    assert upstream.seen == []
    # the probe spent its bytes (denied probes count): now even a short name is over the budget
    assert (await state.snapshot("sbx-budget")).dns_name_bytes == len(exfil)
    assert rcode(await ask(server, "a.budget.example.com", source=BUDGET_IP)) == "REFUSED"
    assert upstream.seen == []


async def test_name_bytes_budget_allows_until_spent(server, upstream):
    name = ".".join(["q" * 60, "r" * 60]) + ".budget.example.com"  # 140 bytes: fits once, not twice
    assert rcode(await ask(server, name, source=BUDGET_IP)) == "NXDOMAIN"  # allowed; upstream has no such name
    assert rcode(await ask(server, name, source=BUDGET_IP)) == "REFUSED"
    assert upstream.names() == [name]


async def test_rate_limit(server, upstream, audit):
    # all six at once: the bucket holds 2 tokens and refills 2/s, so (nearly) all but two are refused
    results = await asyncio.gather(*(ask(server, "allowed.example.com", source=RATE_IP) for _ in range(6)))
    codes = [rcode(r) for r in results]
    assert codes.count("NOERROR") in (2, 3)
    assert codes.count("REFUSED") >= 3
    limited = [e for e in audit.events if e.extra.get("egressgate.decision.detail") == "dns.budget.per_second"]
    assert limited and all(e.reason == "budget_exceeded" and e.sandbox_id == "sbx-rate" for e in limited)
    assert {e.extra["egressgate.dns.stage"] for e in limited} == {"resolver"}  # not a decide() outcome
    assert server.metrics.rate_limited == codes.count("REFUSED")
    await asyncio.sleep(1.1)
    assert rcode(await ask(server, "allowed.example.com", source=RATE_IP)) == "NOERROR"
