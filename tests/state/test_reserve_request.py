"""`reserve_request`: the bytes of a request, its rule's budget and its history in one atomic step
(state/base.py), the same answers on every backend (issue 25: one Redis round trip instead of two)."""

from __future__ import annotations

import asyncio

from egressgate.state.base import MAX_AMOUNT, RequestGrant, StateStore
from tests.state.helpers import record


async def test_reserves_and_records_in_one_step(store: StateStore):
    await store.admit(record())
    grant = await store.reserve_request("sbx", "a.example", "r1", 40, 40, 100, requests_max=5, add_in=7)
    assert grant == RequestGrant(None, 40)
    snap = await store.snapshot("sbx")
    assert (snap.bytes_out, snap.bytes_in) == (40, 7)
    assert snap.seen_hosts == frozenset({"a.example"})
    assert (snap.rule_usage["r1"].requests, snap.rule_usage["r1"].bytes) == (1, 40)
    # the bytes are this worker's lease like reserve_out's: settle gives the unused part back
    await store.settle_out("sbx", 30, 10)
    assert (await store.snapshot("sbx")).bytes_out == 30


async def test_bytes_that_do_not_fit_reserve_and_record_nothing(store: StateStore):
    await store.admit(record())
    assert (await store.reserve_request("sbx", "a.example", "r1", 60, 60, 100)).refused is None
    grant = await store.reserve_request("sbx", "b.example", "r1", 41, 41, 100, add_in=3)
    assert grant == RequestGrant("bytes", 60)  # 40 left: all or nothing, and the 429's figure
    snap = await store.snapshot("sbx")
    assert snap.bytes_out == 60 and snap.bytes_in == 3  # bytes in count whatever the answer
    assert "b.example" not in snap.seen_hosts and snap.rule_usage["r1"].requests == 1
    # positive control: what fits exactly is granted
    assert await store.reserve_request("sbx", "b.example", "r1", 40, 40, 100) == RequestGrant(None, 100)
    assert "b.example" in (await store.snapshot("sbx")).seen_hosts


async def test_a_spent_rule_budget_reserves_and_records_nothing(store: StateStore):
    await store.admit(record())
    assert (await store.reserve_request("sbx", "a.example", "r1", 10, 10, None, requests_max=1)).refused is None
    grant = await store.reserve_request("sbx", "new.example", "r1", 10, 10, None, requests_max=1)
    assert grant.refused == "rule" and grant.bytes_out == 10
    snap = await store.snapshot("sbx")
    assert snap.bytes_out == 10 and "new.example" not in snap.seen_hosts and snap.rule_usage["r1"].requests == 1
    # the rule's bytes budget the same way (it reads nbytes, not what this process had to reserve)
    assert (await store.reserve_request("sbx", "a.example", "r2", 60, 0, None, bytes_max=100)).refused is None
    assert (await store.reserve_request("sbx", "a.example", "r2", 50, 0, None, bytes_max=100)).refused == "rule"
    assert (await store.snapshot("sbx")).rule_usage["r2"].bytes == 60
    # the bytes are checked first: a request refused for both is a byte-budget refusal
    assert (await store.reserve_request("sbx", "a.example", "r1", 10, 10, 15, requests_max=1)).refused == "bytes"


async def test_want_zero_records_without_reserving(store: StateStore):
    """This process already held the bytes (its pool): the step only records, whatever the limit."""
    await store.admit(record())
    assert await store.reserve_request("sbx", "a.example", None, 500, 0, 100) == RequestGrant(None, 0)
    snap = await store.snapshot("sbx")
    assert snap.bytes_out == 0 and snap.seen_hosts == frozenset({"a.example"}) and not snap.rule_usage


async def test_amounts_above_max_are_refused_never_rounded(store: StateStore):
    await store.admit(record())
    assert (await store.reserve_request("sbx", "a.example", "r1", 1, MAX_AMOUNT + 1, None)).refused == "bytes"
    assert (await store.reserve_request("sbx", "a.example", "r1", MAX_AMOUNT + 1, 0, None)).refused == "rule"
    snap = await store.snapshot("sbx")
    assert snap.bytes_out == 0 and not snap.seen_hosts and not snap.rule_usage


async def test_concurrent_requests_hold_both_budgets_exactly(store: StateStore):
    """100 concurrent steps: the rule allows 17, the bytes 12 of them; exactly 12 pass, the rule counts
    exactly those 12 and the byte budget is spent to the byte."""
    await store.admit(record())
    results = await asyncio.gather(
        *(store.reserve_request("sbx", f"h{i}.example", "r1", 10, 10, 125, requests_max=17) for i in range(100))
    )
    assert [g.refused for g in results].count(None) == 12
    assert {g.refused for g in results} == {None, "bytes"}
    snap = await store.snapshot("sbx")
    assert snap.bytes_out == 120 and snap.rule_usage["r1"].requests == 12 and len(snap.seen_hosts) == 12
