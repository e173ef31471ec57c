"""The StateStore additions for MCP (egressgate/mcp/mediator.py), the same assertions on every backend:
call budgets counted all-or-nothing and exactly under concurrency, refunds, and trust-on-first-use pins
that the first writer wins for good (across two replicas on Redis)."""

from __future__ import annotations

import asyncio

import pytest

from egressgate.state.base import StateStore, StateUnavailable
from tests.state.helpers import record, replica_pair

SERVER, TOOL = "mcp:tickets", "mcp:tickets/search"


async def usage(store: StateStore, key: str) -> int:
    return (await store.call_counts("sbx", [key]))[key]


async def test_count_calls_all_or_nothing(store: StateStore):
    await store.admit(record())
    assert await store.count_calls("sbx", [(SERVER, 3), (TOOL, 1)]) is None
    assert (await usage(store, SERVER), await usage(store, TOOL)) == (1, 1)
    # the tool is at its max: refused by that key, and the server counter did not move either
    assert await store.count_calls("sbx", [(SERVER, 3), (TOOL, 1)]) == TOOL
    assert (await usage(store, SERVER), await usage(store, TOOL)) == (1, 1)
    # positive control: another tool of the same server still counts
    assert await store.count_calls("sbx", [(SERVER, 3), ("mcp:tickets/other", None)]) is None
    assert await store.count_calls("sbx", [(SERVER, 3)]) is None
    assert await store.count_calls("sbx", [(SERVER, 3)]) == SERVER
    assert await usage(store, SERVER) == 3
    assert await store.count_calls("sbx", []) is None


async def test_refund_gives_back_one_and_never_goes_negative(store: StateStore):
    await store.admit(record())
    assert await store.count_calls("sbx", [(SERVER, 1), (TOOL, 1)]) is None
    assert await store.count_calls("sbx", [(SERVER, 1)]) == SERVER
    await store.refund_calls("sbx", [SERVER, TOOL])
    assert (await usage(store, SERVER), await usage(store, TOOL)) == (0, 0)
    await store.refund_calls("sbx", [SERVER, "mcp:never-counted"])
    assert await usage(store, SERVER) == 0
    assert await store.count_calls("sbx", [(SERVER, 1)]) is None  # the refunded call is available again


async def test_concurrent_call_budget_is_exact(store: StateStore):
    await store.admit(record())
    results = await asyncio.gather(*(store.count_calls("sbx", [(SERVER, 13), (TOOL, None)]) for _ in range(60)))
    assert results.count(None) == 13 and set(results) == {None, SERVER}
    assert (await usage(store, SERVER), await usage(store, TOOL)) == (13, 13)


async def test_call_counters_are_apart_from_rule_usage_and_history(store: StateStore):
    """A network rule may be named `mcp:tickets` (rule ids allow ':'): its request budget and the MCP
    server's call budget must not be one counter (each would spend the other's)."""
    await store.admit(record())
    assert await store.record_request("sbx", "a.example", SERVER, 5, requests_max=2) is True
    for _ in range(3):
        assert await store.count_calls("sbx", [(SERVER, 5)]) is None
    assert await store.record_request("sbx", "a.example", SERVER, 5, requests_max=2) is True  # 2nd of 2
    assert await store.record_request("sbx", "a.example", SERVER, 5, requests_max=2) is False  # control: 3rd
    snap = await store.snapshot("sbx")
    assert snap.seen_hosts == frozenset({"a.example"})
    assert snap.rule_usage[SERVER].requests == 2 and snap.rule_usage[SERVER].bytes == 10
    assert await store.call_counts("sbx", [SERVER, TOOL]) == {SERVER: 3, TOOL: 0}
    assert await store.call_counts("sbx", []) == {}


async def test_pins_first_value_wins_per_sandbox_and_server(store: StateStore):
    await store.admit(record())
    await store.admit(record("sbx2"))
    assert await store.mcp_pins("sbx", "tickets") == {}
    assert await store.mcp_pin("sbx", "tickets", "server_info", '["t","1.0"]') == '["t","1.0"]'
    assert await store.mcp_pin("sbx", "tickets", "server_info", '["t","2.0"]') == '["t","1.0"]'  # set-if-absent
    assert await store.mcp_pin("sbx", "tickets", "tool:search", "aa") == "aa"
    assert await store.mcp_pin("sbx", "tickets", "tool:a|b", "bb") == "bb"
    # another sandbox, another server: their own first values
    assert await store.mcp_pin("sbx2", "tickets", "server_info", '["t","2.0"]') == '["t","2.0"]'
    assert await store.mcp_pin("sbx", "tickets2", "server_info", '["x","9"]') == '["x","9"]'
    assert await store.mcp_pins("sbx", "tickets") == {"server_info": '["t","1.0"]', "tool:search": "aa",
                                                      "tool:a|b": "bb"}
    assert await store.mcp_pins("sbx", "tickets2") == {"server_info": '["x","9"]'}
    assert await store.count_calls("sbx", [(SERVER, None)]) is None
    assert await store.mcp_read("sbx", "tickets", [SERVER, TOOL]) == (
        {SERVER: 1, TOOL: 0}, await store.mcp_pins("sbx", "tickets"))
    assert await store.mcp_read("sbx", "none", []) == ({}, {})


async def test_concurrent_first_use_has_one_winner(store: StateStore):
    await store.admit(record())
    got = await asyncio.gather(*(store.mcp_pin("sbx", "tickets", "tool:t", f"v{i}") for i in range(40)))
    assert len(set(got)) == 1 and got[0] in {f"v{i}" for i in range(40)}


async def test_replicas_share_pins_and_budgets(redis_server):
    async with replica_pair(redis_server) as (a, b):
        await a.admit(record())
        assert await a.mcp_pin("sbx", "tickets", "tool:t", "first") == "first"
        assert await b.mcp_pin("sbx", "tickets", "tool:t", "second") == "first"
        results = await asyncio.gather(*(s.count_calls("sbx", [(SERVER, 7)]) for s in (a, b) * 10))
        assert results.count(None) == 7


async def test_redis_refuses_to_count_for_a_sandbox_it_lost(redis_server):
    async with replica_pair(redis_server) as (a, _):
        await a.admit(record())
        assert await a.count_calls("sbx", [(SERVER, 1)]) is None
        await a.redis.delete(a.key("sbx", "sbx"))  # Redis lost the record: budgets would restart at 0
        with pytest.raises(StateUnavailable):
            await a.count_calls("sbx", [(SERVER, 1)])


async def test_revoke_expires_the_pins_with_the_counters(redis_server):
    async with replica_pair(redis_server) as (a, _):
        await a.admit(record())
        await a.mcp_pin("sbx", "tickets", "tool:t", "v")
        assert await a.count_calls("sbx", [(SERVER, None)]) is None
        assert await a.revoke("sbx") is True
        assert await a.redis.pttl(a.key("mcp", "sbx")) > 0 and await a.redis.pttl(a.key("calls", "sbx")) > 0
